"""Files: validated memory-mapped GGUF reading, atomic writing, checkpoints, full-model GGUFs."""
