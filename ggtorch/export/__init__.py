"""Paths out of ggtorch: PEFT folders, merged GGUF models, converted old adapters."""
