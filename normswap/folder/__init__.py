"""A converted folder's format, in one package: the `normswap` section of config.json (or a module's normswap.json)
and the code every folder ships as modeling_normswap.py. Light: importing it imports nothing.

- `portable`: the section's checks and the rebuild of a converted model from it (shipped verbatim);
- `checksum`: the weights files a folder's loaders read and the checksum of the section and their headers (shipped);
- `fingerprint`: the behavioural fingerprint a folder's loaders check (shipped);
- `shipped`: the transformers side of the shipped file (`NormswapMixin`: load, save, seal);
- `modeling`: modeling_normswap.py (the shipped modules, then generated classes) and config.json's auto_map;
- `schema`: the shipped checks as normswap raises them (NormswapError);
- `section`: the section as a type (`Section`: to and from its dict, checked), born in its final format, and
  `write`, the one place normswap writes it to a folder;
- `attached`: where a converted model keeps its section in memory.
"""
