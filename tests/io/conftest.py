"""Fixtures of tests/io: llama.cpp's own quantizer (shared with tests/quant) as the oracle."""

from tests.quant.conftest import ggml_quantize  # noqa: F401  (a fixture, used by name)
