"""Pure synchronous model code: GGUF files, block formats, architectures, the forward pass,
tokenizers and chat templates. No actors and no I/O beyond reading the model file."""
