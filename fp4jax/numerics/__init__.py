"""The ground truth of fp4jax's numbers: formats, the operand-spec vocabulary, QTensor, counter-based random
bits, exact float32 helpers, element codecs, Hadamard transforms, the FP8 re-encoding of MXFP4, and the
pure-jnp reference quantizers every kernel and backend is checked against (docs/NUMERICS.md)."""
