"""Pure synchronous model code: GGUF files (`gguf/`), tokenizers and chat templates (`text/`),
and here the math: architectures, weights, the forward pass, attention, RoPE, the step plan
and token candidates, and `loaded` which opens a file into a model. No actors and no I/O
beyond reading the model file."""
