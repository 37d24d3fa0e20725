"""Route diagnostics: how much each operand of a linear layer loses under a route, and what its GEMMs return.

`operand_report(x, w, dy, route)` measures, for the three GEMMs of one linear (fprop Y = X W, dgrad dX = dY W^T,
wgrad dW = X^T dY; docs/ARCHITECTURE.md):
  * per operand role (six): the relative quantization error, the fraction of nonzero inputs that become zero
    codes and the fraction of elements that clip at the element maximum (E2M1 6, E4M3 448, E5M2 57344), all
    in the operand's own basis (after the spec's Hadamard transform, along its GEMM's contraction axis), as
    fp4_dot quantizes it;
  * per GEMM (three): the product fp4_dot returns (forward and vjp) against the exact float32 product: cosine
    similarity, single-sample relative error, and the bias of the mean over `samples` random keys, next to
    the bias an unbiased estimator would show (about error / sqrt(samples)).
`stress_inputs(shape, seed)` gives synthetic tensors that stress the scale rules (heavy tails, sparsity, zero
blocks, tiny values, outliers, a ragged K). Pure JAX and numpy; `fp4jax.nn.diagnostics.capture_linears` takes
x, w and dy from a Llama model (it needs Flax, so it lives in the nn layer).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import route as route_lib
from fp4jax.dot import fp4_dot, padding_multiples
from fp4jax.numerics import prng
from fp4jax.numerics.hadamard import hadamard
from fp4jax.numerics.ints import is_int
from fp4jax.numerics.qtensor import QTensor
from fp4jax.numerics.reference import decode_scales, dequantize
from fp4jax.numerics.spec import OperandKeys, OperandSpec
from fp4jax.ops.quantize.api import quantize_operand
from fp4jax.route import Route

# role -> (which of x, w, dy it reads, the contraction axis of that 2-D array)
ROLE_SOURCES: dict[str, tuple[str, int]] = {
    "fprop_x": ("x", 1), "fprop_w": ("w", 0), "dgrad_dy": ("dy", 1), "dgrad_w": ("w", 1), "wgrad_x": ("x", 0),
    "wgrad_dy": ("dy", 0),
}
STRESS_KINDS = ("normal", "heavy_tailed", "sparse", "zero_blocks", "tiny", "outliers", "ragged_k")


class GemmInputs(NamedTuple):
  """The three arrays of one linear's GEMMs: x [M, K], w [K, N] and the output gradient dy [M, N]."""

  x: np.ndarray | jax.Array
  w: np.ndarray | jax.Array
  dy: np.ndarray | jax.Array


def _padded(x: jax.Array, w: jax.Array, dy: jax.Array, route: Route) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x, w, dy zero-padded as fp4_dot pads them (`dot.padding_multiples`), so every operand is whole blocks."""
  mult = padding_multiples(route)
  (m, k), n = x.shape, w.shape[1]
  mp, kp, np_ = (-(-d // u) * u for d, u in zip((m, k, n), mult))
  pad = lambda a, r, c: jnp.pad(a, ((0, r - a.shape[0]), (0, c - a.shape[1])))
  return pad(x, mp, kp), pad(w, kp, np_), pad(dy, mp, np_)


def _decode_factor(q: QTensor) -> jax.Array:
  """Per element, K-major: the block scale (none for FP8) times the outer factor, the divisor that maps a value to
  an element."""
  scale = jnp.ones(q.kmajor_shape, jnp.float32)
  if q.scales is not None:
    scale = jnp.repeat(decode_scales(q.scales, q.spec), q.spec.block, axis=-1)
  if q.outer is not None:
    scale = scale * (q.outer if q.outer.ndim == 0 else q.outer[..., None])
  return scale


def operand_metrics(v: jax.Array, spec: OperandSpec, axis: int, key: jax.Array | None, role: str,
                    source: jax.Array | None = None) -> dict:
  """Quantization metrics of one operand: `v` (2-D float32) quantized along `axis` per `spec`, as fp4_dot does.

  `source` (default v) is what is quantized; the error is measured against v, both after the transform, so
  for a route that re-quantizes the saved forward FP4 values (`requantize_saved`) it is the total error.
  Returns {"rel_sq_error": ||Q(v) - T(v)||^2 / ||T(v)||^2 (0 for an all-zero v, NaN for a non-finite one),
  "zero_fraction": nonzero T(v)
  elements whose code is +-0 over nonzero T(v) elements, "clip_fraction": elements with |T(v)| / (block scale
  x outer) > the element maximum (6 for E2M1) over all elements, i.e. clipped before rounding (for finite
  inputs the same as saturated codes that were rounded down to the maximum)}, T the spec's transform along
  `axis` (identity without one). A high-precision spec loses nothing: all three are 0. `key`: fp4_dot's key
  (the role's keys are derived from it); None only for a spec that draws no random bits.
  """
  if role not in route_lib.ROLES:
    raise ValueError(f"role {role!r} is not an operand role: {list(route_lib.ROLES)}")
  if key is not None or spec.needs_key:
    prng.check_key(key, f"operand_metrics (role {role!r}, {spec.rounding=}, {spec.transform=})")
  if not spec.quantized:
    return {"rel_sq_error": 0.0, "zero_fraction": 0.0, "clip_fraction": 0.0}
  keys = route_lib.operand_keys(spec, key, role)
  err, norm, zeros, nonzeros, clipped = _operand_sums(v, v if source is None else source, keys, spec, axis)
  return {
      "rel_sq_error": 0.0 if norm == 0 else float(err / norm),  # NaN (not 0) for a non-finite operand
      "zero_fraction": float(zeros / max(nonzeros, 1)),
      "clip_fraction": float(clipped / v.size),
  }


@functools.partial(jax.jit, static_argnames=("spec", "axis"))
def _operand_sums(v: jax.Array, source: jax.Array, keys: OperandKeys, spec: OperandSpec,
                  axis: int) -> tuple[jax.Array, ...]:
  """(squared error, squared norm of T(v), zero codes of nonzero T(v), nonzero T(v), clipped elements)."""
  q = quantize_operand(source, spec, axis, keys, implementation="xla")
  t = v if spec.transform is None else hadamard(v, spec.transform, axis=axis, key=keys.transform)
  tk = jnp.moveaxis(t, axis, -1)  # K-major, as the codes
  nonzero = tk != 0
  zero_code = q.element_values() == 0
  ratio = jnp.abs(tk) / _decode_factor(q)  # NaN only where a zero block has a zero scale: masked below
  return (jnp.sum((dequantize(q) - t) ** 2), jnp.sum(t ** 2), jnp.sum(nonzero & zero_code), jnp.sum(nonzero),
          jnp.sum(jnp.where(nonzero, ratio, 0.0) > q.spec.element_spec.max))


def _products(x: jax.Array, w: jax.Array, dy: jax.Array, route: Route, keys: jax.Array) -> dict[str, jax.Array]:
  """{gemm: [S, ...] products}: fp4_dot's Y, and its vjp's dX and dW for cotangent dy, one per key (vmapped)."""

  def one(key):
    y, vjp = jax.vjp(lambda a, b: fp4_dot(a, b, route=route, key=key, out_dtype=jnp.float32), x, w)
    dx, dw = vjp(dy)
    return {"fprop": y, "dgrad": dx, "wgrad": dw}

  return jax.vmap(one)(keys)


@functools.partial(jax.jit, static_argnames=("route",))
def _gemm_sums(x: jax.Array, w: jax.Array, dy: jax.Array, route: Route, keys: jax.Array) -> dict[str, dict]:
  """{gemm: norms of its products over keys against the exact float32 product}, one compiled program for all
  three GEMMs; `_gemm_metrics` turns them into the report's ratios."""
  hi = jax.lax.Precision.HIGHEST
  exact = {"fprop": jnp.dot(x, w, precision=hi), "dgrad": jnp.dot(dy, w.T, precision=hi),
           "wgrad": jnp.dot(x.T, dy, precision=hi)}
  out = {}
  for gemm, products in _products(x, w, dy, route, keys).items():
    flat = products.reshape(products.shape[0], -1)
    ref = exact[gemm].reshape(-1)
    norms = jnp.linalg.norm(flat, axis=1)
    mean = jnp.mean(flat, axis=0)
    cosines = jnp.where(norms > 0, jnp.dot(flat, ref, precision=hi) / jnp.where(norms > 0, norms, 1.0), 0.0)
    out[gemm] = {
        "ref_norm": jnp.linalg.norm(ref),
        "max_abs": jnp.max(jnp.abs(flat)),
        "cosine_sum": jnp.sum(cosines),
        "error": jnp.sqrt(jnp.mean(jnp.sum((flat - ref) ** 2, axis=1))),
        "bias": jnp.linalg.norm(mean - ref),
        "spread": jnp.sqrt(jnp.mean(jnp.sum((flat - mean) ** 2, axis=1))),
    }
  return out


def _gemm_metrics(sums: dict[str, jax.Array], s: int, deterministic: bool) -> dict:
  """Cosine, single-sample error, bias of the mean and its unbiased expectation over `s` samples (see
  `operand_report`) from one GEMM's `_gemm_sums`."""
  sums = {k: float(v) for k, v in sums.items()}
  ref_norm = sums["ref_norm"]
  if not all(map(math.isfinite, sums.values())):  # a non-finite operand: no metric means anything, say so
    nan = math.nan
    return {"cosine": nan, "rel_error": nan, "bias": nan, "unbiased_bias": nan, "spread": nan,
            "deterministic": deterministic, "samples": s}
  if ref_norm == 0:  # an exact zero product: nothing to be relative to; a zero estimate is exact
    zero = sums["max_abs"] == 0
    return {"cosine": 1.0 if zero else 0.0, "rel_error": 0.0 if zero else math.inf, "bias": 0.0 if zero else math.inf,
            "unbiased_bias": 0.0, "spread": 0.0, "deterministic": deterministic, "samples": s}
  error = sums["error"] / ref_norm
  return {
      "cosine": sums["cosine_sum"] / (s * ref_norm),
      "rel_error": error,
      "bias": sums["bias"] / ref_norm,
      "unbiased_bias": 0.0 if deterministic else error / math.sqrt(s),
      "spread": sums["spread"] / ref_norm,
      "deterministic": deterministic,
      "samples": s,
  }


def operand_report(x, w, dy, route: str | Route, key: jax.Array | None = None, *, samples: int = 16) -> list[dict]:
  """Diagnostics of one linear's three GEMMs under `route`: one row per operand role, one per GEMM.

  Args:
    x: [M, K] activations; w: [K, N] weights; dy: [M, N] the gradient of the loss w.r.t. the output x @ w.
      All are used in float32.
    route: a `Route` or a preset name.
    key: the random key (default key 0); sample i of the GEMM products uses `jax.random.split(key, samples)[i]`
      as fp4_dot's key, and the operand rows use sample 0's key.
    samples: how many keys the GEMM bias is averaged over.
  Shapes that are not whole blocks (a ragged K) are zero-padded as fp4_dot pads them; the operand rows then
  describe the padded operands (padding is exact: zeros add nothing to any product).
  Returns:
    Operand rows {"route", "kind": "operand", "name": role, "fmt", "rounding", "transform", "rel_sq_error",
    "zero_fraction", "clip_fraction"} (`operand_metrics` defines them), then GEMM rows {"route", "kind": "gemm",
    "name": "fprop" | "dgrad" | "wgrad", "cosine": mean over samples of the cosine similarity between the
    product and the exact float32 product, "rel_error": RMS over samples of ||P_k - P|| / ||P||, "bias":
    ||mean_k P_k - P|| / ||P||, "unbiased_bias": rel_error / sqrt(samples), what "bias" comes to for an unbiased
    estimator (0 for a deterministic GEMM), "spread": RMS over samples of ||P_k - mean_k P_k|| / ||P||,
    "deterministic": both operands quantize without random bits (RNE, no random transform; with
    `requantize_saved`, also the fprop recipes that the saved X and W come from): every sample gives the same
    product, spread 0 and bias equal to rel_error, "samples"}. A bias well above unbiased_bias
    means the GEMM is biased; for an unbiased one the two agree to within sampling noise.
  """
  route = route_lib.get(route)
  if not is_int(samples) or samples < 1:
    raise ValueError(f"samples must be an int >= 1, got {samples!r}")
  samples = int(samples)  # a NumPy int too (np.arange's), reported as a plain int (the rows go to JSON)
  x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
  if x.ndim != 2 or w.ndim != 2 or dy.ndim != 2 or x.shape[1] != w.shape[0] or dy.shape != (x.shape[0], w.shape[1]):
    raise ValueError(f"operand_report needs x [M, K], w [K, N], dy [M, N]: {x.shape=}, {w.shape=}, {dy.shape=}")
  if 0 in x.shape + w.shape:
    raise ValueError(f"operand_report needs non-empty operands: {x.shape=}, {w.shape=}")
  if key is not None:
    prng.check_key(key, "operand_report")
  key = jax.random.key(0) if key is None else key
  keys = jax.random.split(key, samples)
  rows = []
  arrays = dict(zip(("x", "w", "dy"), _padded(x, w, dy, route)))
  saved = {}  # requantize_saved: the backward quantizes the dequantized forward FP4 X and W
  if route.requantize_saved:
    for name, role in (("x", "fprop_x"), ("w", "fprop_w")):
      spec, axis = route.spec(role), ROLE_SOURCES[role][1]
      saved[name] = dequantize(quantize_operand(arrays[name], spec, axis, route_lib.operand_keys(spec, keys[0], role),
                                                implementation="xla"))
  for role in route_lib.ROLES:
    name, axis = ROLE_SOURCES[role]
    spec = route.spec(role)
    source = saved.get(name) if role.split("_")[0] != "fprop" else None
    metrics = operand_metrics(arrays[name], spec, axis, keys[0], role, source)
    rows.append({"route": route.name, "kind": "operand", "name": role, "fmt": spec.fmt or "hp",
                 "rounding": spec.rounding, "transform": spec.transform or "", **metrics})
  sums = _gemm_sums(x, w, dy, route, keys)
  for gemm, (_, a, b) in route_lib.GEMMS.items():
    roles = [a, b] + [f"fprop_{ROLE_SOURCES[r][0]}" for r in (a, b)  # a saved X or W: its fprop draws too
                      if route.requantize_saved and gemm != "fprop" and ROLE_SOURCES[r][0] != "dy"]
    deterministic = not any(route.spec(r).needs_key for r in roles)
    rows.append({"route": route.name, "kind": "gemm", "name": gemm,
                 **_gemm_metrics(sums[gemm], samples, deterministic)})
  return rows


def stress_inputs(shape: tuple[int, int], seed: int = 0) -> dict[str, np.ndarray]:
  """Synthetic float32 stress tensors of `shape` [R, C] (R, C multiples of 32 for the block-shaped kinds).

  Kinds (`STRESS_KINDS`): "normal" N(0, 1); "heavy_tailed" Student-t with 2 degrees of freedom (infinite
  variance: rare huge values); "sparse" N(0, 1) with 90% of the elements zero; "zero_blocks" N(0, 1) with
  about half of the 32x32 tiles all zero (an all-zero block along either axis); "tiny" N(0, 1) * 1e-6 (small
  gradients: the scales must follow the magnitude down); "outliers" N(0, 1) with one element per row set to
  +-1e3; "ragged_k" N(0, 1) of shape [R, C'] with C' odd (never a multiple of 16 or 32), which fp4_dot must pad.
  """
  rows, cols = shape
  rng = np.random.default_rng(seed)
  normal = lambda r, c: rng.standard_normal((r, c)).astype(np.float32)
  tiles = rng.random((-(-rows // 32), -(-cols // 32))) < 0.5
  tile_mask = np.repeat(np.repeat(tiles, 32, axis=0), 32, axis=1)[:rows, :cols]
  outliers = normal(rows, cols)
  outliers[np.arange(rows), rng.integers(0, cols, rows)] = 1e3 * rng.choice([-1.0, 1.0], rows)
  return {
      "normal": normal(rows, cols),
      "heavy_tailed": rng.standard_t(2, (rows, cols)).astype(np.float32),
      "sparse": np.where(rng.random((rows, cols)) < 0.9, 0.0, normal(rows, cols)).astype(np.float32),
      "zero_blocks": np.where(tile_mask, 0.0, normal(rows, cols)).astype(np.float32),
      "tiny": normal(rows, cols) * np.float32(1e-6),
      "outliers": outliers,
      "ragged_k": normal(rows, 2 * (cols // 2) + 7),
  }


def stress_cases(m: int, k: int, n: int, seed: int = 0) -> dict[str, GemmInputs]:
  """One linear per stress kind: x [M, K] and dy [M, N] of that kind (`stress_inputs`), w ~ N(0, 1/K).

  The "ragged_k" case has x [M, K'] and w [K', N] with K' odd; dy is normal there.
  """
  xs, dys = stress_inputs((m, k), seed), stress_inputs((m, n), seed + 1)
  rng = np.random.default_rng(seed + 2)
  cases = {}
  for kind in STRESS_KINDS:
    x = xs[kind]
    w = (rng.standard_normal((x.shape[1], n)) / math.sqrt(x.shape[1])).astype(np.float32)
    dy = dys["normal"] if kind == "ragged_k" else dys[kind]
    cases[kind] = GemmInputs(x, w, dy)
  return cases
