"""Which platform JAX is compiling for, where a choice depends on it (the quantizer implementation "auto", the
fp8 GEMM's output dtype).

The default backend answers on a machine with the accelerator; an abstract mesh of GPU devices answers when a
GPU program is lowered on a machine without one (`python -m bench program`), so both see the same program.
"""

from __future__ import annotations

import jax


def compiles_for_gpu() -> bool:
  """True when JAX compiles for a GPU: the default backend is one, or an abstract mesh of GPU devices is in use."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.default_backend() == "gpu" or (device is not None and device.platform == "gpu")
