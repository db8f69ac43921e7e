"""Numerical kernels the models and LoRA call: f32 products on oneDNN, fused RMSNorm/SwiGLU."""
