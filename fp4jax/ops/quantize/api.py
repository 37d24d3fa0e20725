"""Quantize a GEMM operand, one view or both views of an array, with an explicit implementation choice.

Implementations (`IMPLEMENTATIONS`):
  "pallas"     the fused Pallas kernels, compiled for the GPU (`ops.quantize.pallas`);
  "interpret"  the same kernels in Pallas interpret mode (any backend: the CPU tests);
  "xla"        the reference quantizers compiled by XLA (`ops.quantize.xla`): every valid spec, any shape.
"auto" is "pallas" when compiling for a GPU, else "xla". Each choice is an ordered chain ending in "xla": a kernel
that does not cover a case raises NotImplementedError inside, and the next implementation takes over, so
every choice gives the reference's bits and the caller never sees the gap. Invalid input (a spec that cannot
be quantized, a missing key) raises ValueError from whichever implementation meets it.

Both views of one array (`quantize_views`), e.g. X for fprop (along K, the row view) and wgrad (along M, the
column view), come from one pass where a dual-view kernel covers both recipes (the FP8 formats: one XLA
quantization, its transpose the other view); otherwise each view goes through `quantize_operand` on its own.
The Pallas kernels cover the FP4 formats only: FP8 operands always take the XLA link of the chain.

Rows over a mesh (`rows_over`: mesh axes, for an x whose rows are tokens split over them): the kernels run on
each device's own rows where the recipe allows (`pallas.rows`), with the whole array's bits; XLA's SPMD
partitioner would otherwise gather x whole onto every device for them. The XLA link needs nothing: the
partitioner splits the reference's own operations.

Forms: a view comes as a QTensor (packed codes, "codes") or as `ScaledValues` ("values": the bf16 values a GEMM
on bf16 tensor cores reads, what `ops.gemm.operand_form` asks for on Hopper's NVFP4 pairs). The NVFP4
dual-view kernel writes values itself (`pallas.nvfp4`); wherever an implementation returns codes for a view
asked as values, they are decoded here (`numerics.values.scaled_values`), so every form request is met with
the same numbers.

Produced operands: x may be a `numerics.produced.Produced`, the elementwise op that produces it with that op's
inputs (the Llama MLP's SwiGLU). An implementation that `computes_produced` is handed it and
computes x in its own pass where a kernel covers the op (the MXFP4 dual-view kernel, `pallas.sources`); where
it does not, that implementation and the next are handed x's value, computed once by XLA. The numbers are the
same either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from fp4jax.numerics import produced
from fp4jax.numerics.produced import Produced
from fp4jax.numerics.qtensor import QTensor, Quantized
from fp4jax.numerics.spec import OperandKeys, OperandSpec, check_choice
from fp4jax.numerics.values import scaled_values
from fp4jax.ops.quantize import pallas, xla
from fp4jax.platform import compiles_for_gpu


@dataclasses.dataclass(frozen=True)
class Implementation:
  """views(x, row, col, row_keys, col_keys, forms) -> (row view, column view), or None where it has no
  two-view pass; operand(x, spec, axis, keys) -> QTensor. Either raises NotImplementedError for an uncovered
  case. `forms` is a request a kernel may meet (module docstring); `rows_over` is passed to both where
  `splits_rows` (module docstring); an x given as a `Produced` is passed where `computes_produced`, else its
  value (module docstring)."""

  views: Callable[..., tuple[QTensor, QTensor]] | None
  operand: Callable[..., QTensor]
  splits_rows: bool = False
  computes_produced: bool = False


IMPLEMENTATIONS: dict[str, Implementation] = {
    "pallas": Implementation(functools.partial(pallas.views, interpret=False),
                             functools.partial(pallas.operand, interpret=False), splits_rows=True,
                             computes_produced=True),
    "interpret": Implementation(functools.partial(pallas.views, interpret=True),
                                functools.partial(pallas.operand, interpret=True), splits_rows=True,
                                computes_produced=True),
    "xla": Implementation(xla.views, xla.operand),
}
CHOICES = ("auto", *IMPLEMENTATIONS)
FORMS = ("codes", "values")
_CHAINS = {"pallas": ("pallas", "xla"), "interpret": ("interpret", "xla"), "xla": ("xla",)}


def resolve(implementation: str) -> str:
  """The concrete implementation of a choice: "auto" is "pallas" when compiling for a GPU, else "xla"."""
  check_choice("quantizer implementation", implementation, CHOICES)
  if implementation == "auto":
    return "pallas" if compiles_for_gpu() else "xla"
  return implementation


def _chain(implementation: str) -> tuple[Implementation, ...]:
  return tuple(IMPLEMENTATIONS[name] for name in _CHAINS[resolve(implementation)])


def _check(spec: OperandSpec) -> None:
  if not isinstance(spec, OperandSpec) or not spec.quantized:
    raise ValueError(f"quantize needs an OperandSpec with an FP4 format, got {spec!r}")


def _as_form(q: Quantized, form: str) -> Quantized:
  """q in `form` (module docstring): a QTensor asked as "values" is decoded; anything else passes."""
  return scaled_values(q) if form == "values" and isinstance(q, QTensor) else q


def _rows(impl: Implementation, rows_over: tuple[str, ...]) -> dict:
  return {"rows_over": tuple(rows_over)} if impl.splits_rows and rows_over else {}


def _sources(impl: Implementation, x, value: Callable[[], jax.Array]) -> tuple:
  """What `impl` is handed for x, in order: a `Produced` x itself where the implementation can compute it, then
  its value (computed by XLA, once: `value` caches it); an array x alone."""
  if not isinstance(x, Produced):
    return (x,)
  return (x, value()) if impl.computes_produced else (value(),)


def _value_once(x) -> Callable[[], jax.Array]:
  return functools.cache(lambda: produced.value(x))


def quantize_operand(x: jax.Array | Produced, spec: OperandSpec, axis: int, keys: OperandKeys = OperandKeys(), *,
                     implementation: str = "auto", form: str = "codes",
                     rows_over: tuple[str, ...] = ()) -> Quantized:
  """`x` quantized along `axis` per `spec` (after its transform), K-major (`axis` moved last).

  keys: the rounding key (SR, MS-EDEN) and the random-Hadamard key, where the spec draws random bits.
  form: "codes" (a QTensor) or "values" (`ScaledValues` of a 2-D x; module docstring).
  rows_over: mesh axes over which x's rows are split (module docstring); the numbers do not depend on it.
  The kernels cover 2-D inputs; other ranks go to "xla". x may be a `Produced` (module docstring).
  """
  _check(spec)
  check_choice("operand form", form, FORMS)
  value = _value_once(x)
  for impl in _chain(implementation):
    for source in _sources(impl, x, value):
      try:
        return _as_form(impl.operand(source, spec, axis, keys, **_rows(impl, rows_over)), form)
      except NotImplementedError:
        continue
  raise AssertionError("the chain ends in 'xla', which covers every spec")


def quantize_views(x: jax.Array | Produced, row: OperandSpec, col: OperandSpec,
                   row_keys: OperandKeys = OperandKeys(), col_keys: OperandKeys = OperandKeys(), *,
                   implementation: str = "auto", forms: tuple[str, str] = ("codes", "codes"),
                   rows_over: tuple[str, ...] = ()) -> tuple[Quantized, Quantized]:
  """(x [R, C] along axis 1 per `row`: K-major [R, C]; along axis 0 per `col`: K-major [C, R]), from one pass
  over x where a kernel covers both recipes, else one `quantize_operand` each. Passing one key object as both
  views' rounding key draws each element's random bits once (same recipe, same numbers). forms: each view's
  form, "codes" or "values"; rows_over: as for `quantize_operand` (module docstring). x may be a `Produced`
  (module docstring)."""
  _check(row)
  _check(col)
  for form in forms:
    check_choice("operand form", form, FORMS)
  value = _value_once(x)
  for impl in _chain(implementation):
    if impl.views is None:
      continue
    for source in _sources(impl, x, value):
      try:
        views = impl.views(source, row, col, row_keys, col_keys, forms=tuple(forms), **_rows(impl, rows_over))
      except NotImplementedError:
        continue
      return tuple(_as_form(v, form) for v, form in zip(views, forms))
  x = value() if isinstance(x, Produced) else x
  return tuple(quantize_operand(x, spec, axis, keys, implementation=implementation, form=form, rows_over=rows_over)
               for spec, axis, keys, form in ((row, 1, row_keys, forms[0]), (col, 0, col_keys, forms[1])))
