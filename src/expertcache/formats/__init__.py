"""File formats read in one place each, headers only, in bounded memory: ``gguf`` (a GGUF's tensor
table and MoE geometry, sized with the ``gguf`` package's type table) and ``safetensors`` (a
safetensors file's JSON header). Every mistake is one ConfigError line naming the file."""
