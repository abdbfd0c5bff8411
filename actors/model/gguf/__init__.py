"""GGUF files: reading them (`reader`), the block formats and their quantizers (`quants`),
quantizing a whole file (`quantize_file`) and the inventory of a file's tensors (`inventory`)."""
