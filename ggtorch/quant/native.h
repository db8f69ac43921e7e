/* What native.c exports (the one-pass decoders). native.py reads each function's ctypes signature from these
 * prototypes (ggtorch.ops.clib.prototypes) and native.c includes this header, so the compiler holds each
 * definition to the signature Python calls. */
#ifndef GGTORCH_NATIVE_H
#define GGTORCH_NATIVE_H

#include <stdint.h>

/* Decode n_blocks blocks of ggml type `ggml_type` from src into dst (n_blocks * block size values: f32, or
 * bf16 when `bf16` is not 0) on `threads` threads of the OpenMP runtime the library is linked to (torch's:
 * native.py links the one the process has loaded, so its workers, spinning after the last product, take the
 * blocks at once instead of competing with new threads for the cores), or on the caller's thread in a build
 * without OpenMP. Returns 0, or -1 when the type is not one of TYPES (the caller decodes it another way). */
int ggtorch_dequantize(int ggml_type, const uint8_t *src, void *dst, int64_t n_blocks, int threads, int bf16);

/* The ggml types this library decodes, for native.py to check against its TYPES. */
int ggtorch_native_types(int *out, int capacity);

#endif
