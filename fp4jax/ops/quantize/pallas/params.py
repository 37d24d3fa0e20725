"""The parameter row each program of the fused NVFP4 quantizer (`pallas.nvfp4`) reads: the per-tensor (or
per-row-tile) scalars of a view, derived in XLA from its amax with the reference's own functions (the
module docstring of `pallas.nvfp4` says why the kernel divides nowhere).

Row layout (N_PARAMS float32, a power-of-two width): [g = S_enc * c, q_0 .. q_7, S_enc (S_ENC_SLOT),
g4 = S_enc * c4 (G4_SLOT, 4/6's second target), L (SHIFT_SLOT), the block scale caps `reference.scale_cap(outer)`
(CAP_SLOT) and `scale_cap(outer, 4)` (CAP4_SLOT, 4/6's target 4; 0 in the other formats' rows), 0 ...].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.numerics import ieee, reference
from fp4jax.numerics.formats import E2M1_MAX, get_format

N_PARAMS = 16
S_ENC_SLOT, G4_SLOT, SHIFT_SLOT, CAP_SLOT, CAP4_SLOT = 9, 10, 11, 12, 13
MANTISSAS = np.array([1 + j / 8 for j in range(8)], np.float32)  # E4M3 significands, exact in float32


def view_params(amaxes: tuple[jax.Array, jax.Array], roundings: tuple[str, str], steps: tuple[int, int],
                fmt: str) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """`_params_of`, its steps dropped where both amaxes are scalars (where they do not matter): every launch of
  a recipe with a tensor-wide S_enc then shares one trace and one lowering of its parameter arithmetic, whatever
  x's shape and tile."""
  scalars = all(jnp.ndim(a) == 0 for a in amaxes)
  return _params_of(tuple(amaxes), roundings, None if scalars else steps, fmt)


def _stage(values):
  """`values` through an optimization barrier: the end of one stage of `_params_of`'s scalar chain.

  Left whole, the chain (a few hundred elementwise instructions: correctly rounded divisions, lifts, cap steps)
  is what XLA's priority fusion spent most of its time on in an NVFP4 step: it grows the chain into one fusion
  after another, re-analysing the grown fusion at each step, and copies it into each consumer. A scanned NVFP4
  Llama layer holds 12 chains; priority fusion took 2.5 s of the Llama-30M nvfp4 step's 9.6 s XLA compile on an
  H100 (bf16's: 0.5 s); compiled for an H200 on a CPU, 1.0 s with the rows stubbed out against 2.3-4.3 s with
  them. In stages, each fuses on its own, into fewer kernels (docs/BENCHMARKS.md, "Session of 2026-12-07, 00:24
  UTC").
  A barrier is the identity: the values are unchanged."""
  return jax.lax.optimization_barrier(values)


@functools.partial(jax.jit, static_argnames=("roundings", "steps", "fmt"))
def _params_of(amaxes: tuple[jax.Array, jax.Array], roundings: tuple[str, str], steps: tuple[int, int] | None,
               fmt: str) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """((row params [P_r, 16], column params [P_c, 16]), (row outer, column outer)) of both views from their
  amaxes (() each, or one per K-major row): one vectorized pass over every program's values, so the divisions
  (`ieee.div`, a few dozen XLA instructions each) appear once per call instead of once per view.

  `steps`: K-major rows per program, used to pick each program's S_enc (constant within a program: programs
  never straddle a row tile); None for scalar amaxes. Each row as the module docstring lays it out:
  q_j = 1 / fp32((1 + j/8) * outer * 2^L), L = 64 where outer is subnormal, else 0 (`ieee.lift`; the kernel's
  `_block_encode` scales back by 2^L). The outers are `reference.nvfp4_outer` of each view's S_enc, per row.
  """
  steps = steps or (1, 1)  # read for per-row amaxes only
  per_program = [a.reshape(-1)[::step] if a.ndim else a.reshape(1) for a, step in zip(amaxes, steps)]  # [P]
  counts = [int(a.shape[0]) for a in per_program]
  heads = [reference.NV_HEADROOM[r] for r in roundings]
  column = lambda values: np.concatenate([np.full((n,), v, np.float32) for n, v in zip(counts, values)])
  amax = jnp.concatenate(per_program)  # [P_r + P_c]
  scale_max = get_format(fmt).scale_max
  # reference.nvfp4_encode_scale with each view's headroom: the numerator fp32(scale_max / H * 6) per program
  numerators = column([np.float32(scale_max / h * E2M1_MAX) for h in heads])
  s = _stage(ieee.amax_factor(numerators, amax))
  outer = _stage(reference.nvfp4_outer(s))
  g = s * column([reference.nv_inv_target(E2M1_MAX, h) for h in heads])  # NaN marks a non-finite amax
  o, shift = _stage(ieee.lift(outer))  # outer * 2^L, normal
  # [P, 8]: each q is normal, zero or NaN, as `normal_result` asks. o * (1 + j/8) is >= 2^-126 (o normal) and
  # <= 1.875 / S_enc <= 1.875 * float32 max / numerator, so q >= numerator / (1.875 * float32 max) > 2^-126
  # for numerators >= 8 (theirs are >= 1445); or o is infinite (S_enc = 0: q = 0) or NaN.
  assert numerators.min() >= 8, numerators
  q = _stage(ieee.div(np.float32(1.0), o[:, None] * MANTISSAS[None, :], b_normal=True, normal_result=True))
  g4 = s * column([reference.nv_inv_target(4.0, h) for h in heads])
  four_six = fmt == "nvfp4_46"  # the only kernel that reads CAP4_SLOT (the others' rows hold 0 there)
  caps = _stage(reference.scale_caps(outer, (E2M1_MAX, 4.0) if four_six else (E2M1_MAX,)))
  pad = np.zeros((s.shape[0], N_PARAMS - 14), np.float32)
  columns = [g, *q.T, s, g4, shift.astype(jnp.float32), caps[0], caps[1] if four_six else jnp.zeros_like(outer)]
  params = jnp.concatenate([jnp.stack(columns, 1), pad], 1)
  split = lambda v: (v[:counts[0]], v[counts[0]:])
  outers = tuple(o.reshape(()) if a.ndim == 0 else jnp.repeat(o, step)  # per program -> per K-major row
                 for o, a, step in zip(split(outer), amaxes, steps))
  return split(params), outers
