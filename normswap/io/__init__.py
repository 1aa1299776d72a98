"""Files on disk, below `models/`: safetensors files read and written a tensor at a time (`safetensors`), the
converted folder's format and the code it ships (`portable`), what normswap writes (`owned`), safe outputs
(`atomic`) and where the bundled demo model lives (`bundled`). Light: importing it imports nothing."""
