"""FP4 GEMM backends, one table: name -> `Backend` (a lazily imported module with `gemm` and `supports`).

Every backend computes `gemm(a, b, *, out_dtype) = dequant(a) @ dequant(b).T` for K-major QTensors
a [M, K], b [N, K] (docs/ARCHITECTURE.md), with the same numbers as "emulated". `default_backend` picks the
fastest one the device and the operands allow; `select(a, b, impl)` honours an explicit choice.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import jax

from fp4jax.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class Backend:
  """A GEMM backend module, imported on first use (so a missing or GPU-only module breaks nothing else)."""

  name: str
  module: str

  def load(self) -> ModuleType | None:
    """The module, or None if it is not importable here."""
    try:
      return importlib.import_module(self.module)
    except ModuleNotFoundError as e:
      if e.name != self.module:  # The module exists but something it imports is broken: say so.
        raise
      return None

  @property
  def available(self) -> bool:
    return self.load() is not None

  def supports(self, a: QTensor, b: QTensor) -> bool:
    mod = self.load()
    return mod is not None and bool(mod.supports(a, b))

  def gemm(self, a: QTensor, b: QTensor, *, out_dtype):
    mod = self.load()
    if mod is None:
      raise ValueError(f"GEMM backend {self.name!r} is not available (module {self.module} not found)")
    return mod.gemm(a, b, out_dtype=out_dtype)


BACKENDS: dict[str, Backend] = {
    name: Backend(name, f"fp4jax.kernels.gemm_{name}") for name in ("emulated", "fp8", "native")
}

# Device generation -> backends to try, fastest first ("emulated" supports every operand pair).
_PREFERENCE: dict[str, tuple[str, ...]] = {
    "sm100": ("native", "fp8", "emulated"),
    "sm90": ("fp8", "emulated"),
    "other": ("emulated",),
}


def device_generation(device: jax.Device | None = None) -> str:
  """"sm100" (Blackwell and newer), "sm90" (Hopper) or "other" (CPU, TPU, older GPUs)."""
  device = device or jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc:
    return "other"
  major = int(str(cc).split(".")[0])
  return "sm100" if major >= 10 else "sm90" if major == 9 else "other"


def default_backend(a: QTensor, b: QTensor) -> str:
  """The name of the fastest backend for this device that supports (a, b)."""
  for name in _PREFERENCE[device_generation()]:
    if BACKENDS[name].supports(a, b):
      return name
  raise ValueError(f"no GEMM backend supports {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")


def select(a: QTensor, b: QTensor, impl: str | None = None) -> Backend:
  """The backend named `impl` (None: `default_backend`); fails clearly if it cannot run (a, b)."""
  if impl is None:
    return BACKENDS[default_backend(a, b)]
  if impl not in BACKENDS:
    raise ValueError(f"unknown GEMM backend {impl=}; known: {list(BACKENDS)}")
  backend = BACKENDS[impl]
  if not backend.available:
    raise ValueError(f"GEMM backend {impl=} is not available here (module {backend.module} not found)")
  if not backend.supports(a, b):
    raise ValueError(f"GEMM backend {impl=} does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} "
                     f"{b.kmajor_shape=}")
  return backend


def gemm(a: QTensor, b: QTensor, *, out_dtype, impl: str | None = None) -> jax.Array:
  """dequant(a) @ dequant(b).T on the selected backend."""
  return select(a, b, impl).gemm(a, b, out_dtype=out_dtype)
