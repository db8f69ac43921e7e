"""The llama model: config from GGUF metadata, the torch module, GGUF name maps, loader, tokenizer."""
