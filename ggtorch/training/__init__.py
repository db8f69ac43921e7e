"""Training: the run's options, ggml's AdamW, the losses, the trainer loop, torchrun, the log."""
