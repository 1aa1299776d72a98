"""Files on disk, below `models/`: safetensors files read and written a tensor at a time (`safetensors`, named
as the converted folder's format says: `folder.checksum`), what normswap writes (`owned`), safe outputs (`atomic`)
and where the bundled demo model lives (`bundled`). Light: importing it imports nothing."""
