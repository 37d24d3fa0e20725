"""fp4jax's benchmarks, an app beside `train/` that uses fp4jax's public API: `python -m bench <subcommand>`.

Subcommands: `dot` (GEMMs and fp4_dot at Llama-8B shapes), `quantize` (the fused quantizers against XLA and a
copy), `compile` (fp4_dot compile time per route), `triton` (the Pallas kernels' Triton compile time, no GPU
needed). docs/BENCHMARKS.md holds the measured tables with their commands.
"""
