"""Hopper (sm90) GEMM of two MXFP4 operands as ONE Mosaic GPU kernel that applies the per-row factors itself.

The `fp8` backend multiplies the operands' E4M3 re-encodings (`numerics.fp8`) with cuBLASLt, which scales only
per tensor: it takes that path where each tensor spans <= 2^14 in block exponents and the per-row one, with a
pass over the output, otherwise, and a `lax.cond` picks at run time (XLA:GPU copies the predicate to the host
and waits for it, and compiles both branches). This backend always takes the per-row encoding
(`numerics.fp8.mx_to_fp8`) and scales the float32 accumulator by 2^(e_a + e_b) before its one rounding to
out_dtype: no branch, no pass over the output, the numbers of the fp8 backend's per-row path
(`fp8.apply_factors`: the exponent applied in two halves, so that no partial product leaves float32's
range first; a NaN factor makes its row or column NaN).

The kernel: persistent CTAs (one per SM) walk the output tiles; a producer warpgroup streams [tile, 128] slices
of both K-major operands into shared memory by TMA (`plgpu.emit_pipeline_warp_specialized`), two consumer
warpgroups each multiply their half of the CTA tile with FP8 WGMMA (both operands K-major, as FP8 WGMMA needs)
into a float32 accumulator; the epilogue loads the tile's row and column factors into registers, scales,
rounds and writes 64 x 64 sub-tiles through shared memory. Measured on an H100 it multiplies about as fast as
cuBLASLt with the same bits, but whole Llama-1B mxfp4 steps ran slightly slower than on `fp8` and compiled
slower when scanned (docs/BENCHMARKS.md, "Session of 2026-12-05, 18:01"): it is kept as the GEMM a kernel
decoding MXFP4 codes in its prologue would grow from (issue 13), not as a default.

Not picked by "auto" (`registry`): chosen by name, `Impl(gemm="mosaic")`. Shapes: M and N multiples of 128 with
one of them a multiple of 256, K a multiple of 128 (`tile_config`). Runs on a Hopper GPU, or on any machine in
Mosaic GPU's interpret mode (`jax._src.pallas.mosaic_gpu.interpret.params.force_gpu_interpret_mode`, the tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # pylint: disable=g-direct-jax-src: whether interpret mode is forced

from fp4jax.numerics import fp8 as encoding
from fp4jax.numerics.qtensor import QTensor, Quantized
from fp4jax.ops.gemm import fp8
from fp4jax.platform import compiles_for_gpu

_EPI = 64  # epilogue sub-tile (rows and columns)
_OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiles of the kernel: each consumer warpgroup computes [tile_m, tile_n]; the two split the CTA's tile along
  N (`split_n`) or M. `stages`: K slices in flight. `band`: output tiles of one band visited together (the
  planar snake of `plgpu.planar_snake`), for reuse in L2."""

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  stages: int = 4
  split_n: bool = True
  band: int = 8

  @property
  def cta(self) -> tuple[int, int]:
    return (self.tile_m, 2 * self.tile_n) if self.split_n else (2 * self.tile_m, self.tile_n)


def tile_config(m: int, n: int, k: int, out_dtype=jnp.bfloat16) -> TileConfig | None:
  """The kernel's tiles for out [m, n] over k, or None where they do not divide the shape: 128 x 256 CTA tiles
  where N allows (the faster at most Llama shapes, H100), else 256 x 128; 3 K slices in flight for a float32
  output, whose epilogue buffers leave no room for a fourth in the 227 KiB of shared memory."""
  if k % 128:
    return None
  stages = 3 if jnp.dtype(out_dtype).itemsize > 2 else 4
  for cfg in (TileConfig(split_n=True, stages=stages), TileConfig(split_n=False, stages=stages)):
    cm, cn = cfg.cta
    if m % cm == 0 and n % cn == 0:
      return cfg
  return None


def _is_mxfp4(q: Quantized) -> bool:
  return isinstance(q, QTensor) and q.spec.scale == "e8m0" and q.spec.block == 32 and q.outer is None


def supports(a: Quantized, b: Quantized) -> bool:
  """Two 2-D MXFP4 QTensors of one K whose product the kernel's tiles cover (`tile_config`)."""
  if not (_is_mxfp4(a) and _is_mxfp4(b)) or len(a.shape) != 2 or len(b.shape) != 2:
    return False
  (m, k), (n, k2) = a.kmajor_shape, b.kmajor_shape
  return k == k2 and tile_config(m, n, k) is not None


def _interpreting() -> bool:
  """Whether Mosaic GPU kernels run in interpret mode here (`force_gpu_interpret_mode`)."""
  return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def _num_sms() -> int:
  """Streaming multiprocessors of the GPU compiled for (the abstract mesh's, else the first device's)."""
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None:
    return abstract.num_cores
  return getattr(jax.devices()[0], "core_count", 0) or 4  # interpret mode on a CPU: a few CTAs


def _swizzled(minor_bytes: int, itemsize: int) -> tuple:
  swizzle = plgpu.find_swizzle(minor_bytes * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def scaled_fp8_matmul(a: jax.Array, ra: jax.Array, b: jax.Array, rb: jax.Array, *, out_dtype,
                      config: TileConfig | None = None) -> jax.Array:
  """(a * ra[:, None]) @ (b * rb[:, None])^T for float8_e4m3fn a [M, K], b [N, K] (K-major) and float32 power-of-
  two (or NaN) factors ra [M], rb [N]: float32 accumulation, the factors applied to it, one rounding to
  out_dtype. `config`: `tile_config`'s by default."""
  (m, k), (n, k2) = a.shape, b.shape
  cfg = config or tile_config(m, n, k, out_dtype)
  if k != k2 or cfg is None or jnp.dtype(out_dtype) not in map(jnp.dtype, _OUT_DTYPES):
    raise ValueError(f"scaled_fp8_matmul: {a.shape=} x {b.shape=} to {out_dtype} is not tiled ({cfg})")
  cta_m, cta_n = cfg.cta
  m_tiles, n_tiles, k_steps = m // cta_m, n // cta_n, k // cfg.tile_k
  in_transforms = _swizzled(cfg.tile_k, 1)
  out_size = jnp.dtype(out_dtype).itemsize
  out_transforms = _swizzled(_EPI * out_size, out_size)

  def kernel(a_gmem, ra_gmem, b_gmem, rb_gmem, out_gmem):
    def pipeline(body, context):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
          max_concurrent_steps=cfg.stages, compute_context=context,
          in_specs=[plgpu.BlockSpec((rows, cfg.tile_k), lambda step: (0, step), transforms=in_transforms,
                                    memory_space=plgpu.SMEM, delay_release=1) for rows in (cta_m, cta_n)])

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        out_smem=plgpu.SMEM((2, 2, _EPI, _EPI), out_dtype, transforms=out_transforms), collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tiles(info):
        (tile,) = info.index
        mi, ni = plgpu.planar_snake(tile, (m_tiles, n_tiles), 1, cfg.band)
        rows, cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
        wg_rows = slice(None) if cfg.split_n else pl.ds(wg * cfg.tile_m, cfg.tile_m)
        wg_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n) if cfg.split_n else slice(None)

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
          def _acc(acc_ref):
            run_pipeline(acc_ref)
            ra = plgpu.load(ra_gmem.at[rows].at[wg_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            rb = plgpu.load(rb_gmem.at[cols].at[wg_cols], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            acc = acc_ref[...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for i in range(cfg.tile_m // _EPI):
              for j in range(cfg.tile_n // _EPI):
                sub_r, sub_c = slice(i * _EPI, (i + 1) * _EPI), slice(j * _EPI, (j + 1) * _EPI)
                shape = (_EPI, _EPI)
                out = fp8.apply_factors(acc[sub_r, sub_c], lax.broadcast_in_dim(ra[sub_r], shape, [0]),
                                        lax.broadcast_in_dim(rb[sub_c], shape, [1]))
                slot = (i * (cfg.tile_n // _EPI) + j) % 2
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, slot] = out.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[rows, cols].at[wg_rows, wg_cols]
                                        .at[pl.ds(i * _EPI, _EPI), pl.ds(j * _EPI, _EPI)])

        def mma(_, a_smem, b_smem, acc_ref):
          plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[wg_cols].T)
          plgpu.wgmma_wait(1)  # the previous step's WGMMA; its slices were held one step longer (delay_release)
          return acc_ref

        pipeline(mma, context)(a_gmem.at[rows, :], b_gmem.at[cols, :], allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(_num_sms(),), grid_names=("sm",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return call(a, ra.astype(jnp.float32), b, rb.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def gemm(a: Quantized, b: Quantized, *, out_dtype=jnp.float32) -> jax.Array:
  """dequant(a) @ dequant(b).T for K-major MXFP4 a [M, K], b [N, K]: both re-encoded per row
  (`numerics.fp8.mx_to_fp8`), then `scaled_fp8_matmul`."""
  if not supports(a, b):
    raise ValueError(f"mosaic gemm does not support {a.fmt=} {a.kmajor_shape=} x {b.fmt=} {b.kmajor_shape=}")
  if not (compiles_for_gpu() or _interpreting()):
    raise ValueError("the mosaic GEMM backend compiles for a Hopper GPU (or runs in Mosaic GPU's interpret "
                     "mode): JAX's default backend is not a GPU; choose gemm 'auto' (the fastest backend that runs "
                     "here) or 'emulated'")
  a8, b8 = encoding.mx_to_fp8(a), encoding.mx_to_fp8(b)
  return scaled_fp8_matmul(a8.values, a8.row_scale, b8.values, b8.row_scale, out_dtype=out_dtype)
