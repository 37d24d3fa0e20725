"""The FP4 GEMM backends by name, and the choice among them.

Every backend computes `gemm(a, b, *, out_dtype) = dequant(a) @ dequant(b).T` for K-major operands a [M, K],
b [N, K] (QTensors; `ScaledValues` where the backend reads them, `operand_form`) with the numbers of
"emulated" (`base`). "auto" picks the fastest backend the device generation and
the operands allow; a name picks that backend, and fails clearly where it cannot run the operands.
"""

from __future__ import annotations

from types import ModuleType

import jax

from fp4jax.numerics.qtensor import Quantized
from fp4jax.ops.gemm import emulated, fp8, mosaic, native

# "mosaic" is chosen by name only: no generation prefers it (its module docstring).
BACKENDS: dict[str, ModuleType] = {"emulated": emulated, "fp8": fp8, "mosaic": mosaic, "native": native}
CHOICES = ("auto", *BACKENDS)

# Device generation -> backends to try, fastest first ("emulated" supports every operand pair).
_PREFERENCE: dict[str, tuple[str, ...]] = {
    "sm100": ("native", "fp8", "emulated"),
    "sm90": ("fp8", "emulated"),
    "other": ("emulated",),
}


# Device kinds by generation, for an abstract GPU mesh (no compute capability to read): lowering for an H200 on
# a machine without one must pick the backends the H200 itself would.
_KIND_GENERATION = {"H100": "sm90", "H200": "sm90", "H800": "sm90", "GH200": "sm90", "B200": "sm100",
                    "B300": "sm100", "GB200": "sm100", "GB300": "sm100"}


def device_generation(device: jax.Device | None = None) -> str:
  """"sm100" (Blackwell and newer), "sm90" (Hopper) or "other" (CPU, TPU, older GPUs) for `device` (default: the
  abstract mesh's GPU when one is in use, as `fp4jax.platform.compiles_for_gpu` sees it, else the first device
  of JAX's default backend)."""
  if device is None:
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract is not None and abstract.platform == "gpu":
      words = str(abstract.device_kind).replace("-", " ").split()
      return next((_KIND_GENERATION[w] for w in words if w in _KIND_GENERATION), "other")
  device = device or jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc:
    return "other"
  major = int(str(cc).split(".")[0])
  return "sm100" if major >= 10 else "sm90" if major == 9 else "other"


def check_choice(backend: str) -> None:
  """Raises a ValueError naming the valid choices when `backend` is not one."""
  if backend not in CHOICES:
    raise ValueError(f"unknown GEMM backend {backend!r}; valid: {list(CHOICES)}")


def select(a: Quantized, b: Quantized, backend: str = "auto") -> str:
  """The backend that runs (a, b): the fastest supporting one for "auto", else `backend` if it supports them."""
  check_choice(backend)
  if backend == "auto":
    for name in _PREFERENCE[device_generation()]:
      if BACKENDS[name].supports(a, b):
        return name
    raise ValueError(f"no GEMM backend supports {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")
  if not BACKENDS[backend].supports(a, b):
    raise ValueError(f"GEMM backend {backend!r} does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} "
                     f"{b.kmajor_shape=}")
  return backend


def gemm(a: Quantized, b: Quantized, *, out_dtype, backend: str = "auto") -> jax.Array:
  """dequant(a) @ dequant(b).T on `backend` ("auto": the fastest that supports a and b here)."""
  return BACKENDS[select(a, b, backend)].gemm(a, b, out_dtype=out_dtype)


def operand_form(fmt_a: str, fmt_b: str, backend: str = "auto") -> str:
  """How to hand both operands of a GEMM of these formats to `backend` ("auto": the first of the device
  generation's preference): "values" where it multiplies them as bf16 `ScaledValues` (the Hopper backend's
  NVFP4 pairs), so that the quantizer writes those instead of packed codes and no pass decodes them; else
  "codes". Either form gives the same product."""
  check_choice(backend)
  name = _PREFERENCE[device_generation()][0] if backend == "auto" else backend
  return "values" if name == "fp8" and fp8.reads_values(fmt_a, fmt_b) else "codes"
