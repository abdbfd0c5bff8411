"""GGUF files: reading them (`reader`), the block formats and dequantizing (`quants`),
llama.cpp's reference quantizers (`quantizers`), quantizing a whole file (`quantize_file`) and
the inventory of a file's tensors (`inventory`)."""
