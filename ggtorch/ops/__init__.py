"""Numerical kernels the models and LoRA call (f32 products on oneDNN, fused RMSNorm/SwiGLU) and
the process settings they run under (the thread team, glibc's malloc)."""
