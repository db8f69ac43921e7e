"""ggtorch: finetune GGUF models with PyTorch, output what llama.cpp loads."""

__version__ = "0.1.0"
