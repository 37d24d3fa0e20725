"""Llama building blocks: RMSNorm, RoPE, GQA attention, SwiGLU MLP, the transformer block.

Every dense layer is an `FP4Linear` whose route comes from `RouteRules.resolve(path)` at construction,
`path` being its dotted module path in the model (see fp4jax/nn/rules.py). Random keys: each linear gets
`prng.fold_in(key, index)` (fp4jax's cheap `jax.random.fold_in`) with the fixed per-linear index documented in
`linear_index`; linears run as
one product (`LlamaConfig.fuse_linears`: q, k, v and gate, up) draw the first one's key.

Shapes: B batch, T sequence, D model dim, H query heads, K kv heads, Dh head dim, F ffn dim.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention  # pylint: disable=g-direct-jax-src: its seed

from fp4jax import platform
from fp4jax.impl import Impl
from fp4jax.nn import linear
from fp4jax.nn.linear import FP4Linear
from fp4jax.nn.llama.config import Llama3RopeScaling, LlamaConfig
from fp4jax.nn.rules import RouteRules
from fp4jax.numerics import prng, produced

ATTN_LINEARS = ("q", "k", "v", "o")
MLP_LINEARS = ("gate", "up", "down")
LINEARS_PER_BLOCK = len(ATTN_LINEARS) + len(MLP_LINEARS)


def linear_index(path: str, *, n_layers: int | None = None) -> int:
  """The fixed index i of the linear at `path` (a path of `Llama.routes()`); it receives `fold_in(key, i)` from
  the model's key.

  layers.{l}.attn.{q,k,v,o} -> 7l + 0..3, layers.{l}.mlp.{gate,up,down} -> 7l + 4..6, and lm_head -> 7 * n_layers,
  after every block's: it needs the model's `n_layers`, which also bounds l when given. Another path, or lm_head
  without n_layers, is a ValueError.
  """
  if path == "lm_head":
    if n_layers is None:
      raise ValueError("linear_index('lm_head') needs the model's n_layers=: the lm_head's index is 7 * n_layers")
    return LINEARS_PER_BLOCK * n_layers
  match = re.fullmatch(r"layers\.(\d+)\.(attn|mlp)\.(\w+)", path) if isinstance(path, str) else None
  if match is None or match[3] not in (ATTN_LINEARS if match[2] == "attn" else MLP_LINEARS) or (
      n_layers is not None and int(match[1]) >= n_layers):
    blocks = "l" if n_layers is None else f"l < {n_layers}"
    raise ValueError(f"linear_index takes the path of a Llama linear, layers.{{{blocks}}}.attn.{{q,k,v,o}}, "
                     f"layers.{{{blocks}}}.mlp.{{gate,up,down}} or lm_head, got {path!r}")
  return _block_linear_index(int(match[1]), match[2], match[3])


def _block_linear_index(layer: int | jax.Array, group: str, name: str) -> int | jax.Array:
  """`linear_index` of `layers.{layer}.{group}.{name}`; `layer` may be traced (a scan over blocks)."""
  names = ATTN_LINEARS if group == "attn" else MLP_LINEARS
  offset = 0 if group == "attn" else len(ATTN_LINEARS)
  return LINEARS_PER_BLOCK * layer + offset + names.index(name)


def _fold(key: jax.Array | None, layer: int | jax.Array, group: str) -> dict[str, jax.Array | None]:
  """Each linear of `group`'s key, fold_in(key, its index), derived in one vectorized `prng.fold_in`."""
  names = ATTN_LINEARS if group == "attn" else MLP_LINEARS
  if key is None:
    return dict.fromkeys(names)
  keys = prng.fold_in(key, jnp.stack([jnp.asarray(_block_linear_index(layer, group, n), jnp.uint32)
                                      for n in names]))
  return {n: keys[i] for i, n in enumerate(names)}


def fsdp_sharding(shape: tuple[int, ...]) -> tuple[str | None, ...]:
  """Shard the largest dim of a weight over the "fsdp" mesh axis (the first of equal ones), the rest None."""
  axis = int(np.argmax(shape))
  return tuple("fsdp" if i == axis else None for i in range(len(shape)))


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32 and cast back to x's dtype."""

  def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    del rngs  # Deterministic init (ones); kept for the uniform module signature.
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(None,), eager_sharding=False)  # [D]

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)  # [..., D]
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
  """Rotary angular frequencies [Dh/2] in float64 (constants), with optional Llama 3.1 scaling.

  Llama 3.1 scaling (Meta's reference `apply_scaling`): with wavelength w = 2 pi / f and
  L = original_max_position, frequencies with w < L / high_freq_factor are kept, those with
  w > L / low_freq_factor are divided by `factor`, and in between they are blended:
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor),  f' = (1 - s) f / factor + s f.
  """
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [Dh/2]
  if scaling is None:
    return freqs
  wavelen = 2 * math.pi / freqs
  length = scaling.original_max_position
  smooth = (length / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
  blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
  return np.where(wavelen < length / scaling.high_freq_factor, freqs,
                  np.where(wavelen > length / scaling.low_freq_factor, freqs / scaling.factor, blended))


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
  """Rotate x [B, T, N, Dh] by angle positions[t] * freqs[j], in float32, cast back to x's dtype.

  Pairs are (x[..., j], x[..., j + Dh/2]) (the "rotate half" layout), not interleaved (2j, 2j+1): the two
  are permutations of each other and train identically from scratch, and halves avoid strided gathers.
  """
  angles = positions[:, :, None].astype(jnp.float32) * jnp.asarray(freqs, jnp.float32)  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, N, Dh/2] each
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class _Linears:
  """Builds the FP4Linear at `{prefix}.{name}` with its route from the rules, `impl` and FSDP sharding."""

  def __init__(self, config: LlamaConfig, rules: RouteRules, impl: Impl, prefix: str, rngs: nnx.Rngs,
               dtype: Any, param_dtype: Any):
    self.config, self.rules, self.impl, self.prefix = config, rules, impl, prefix
    self.rngs, self.dtype, self.param_dtype = rngs, dtype, param_dtype

  def __call__(self, name: str, d_in: int, d_out: int) -> FP4Linear:
    return FP4Linear(
        d_in, d_out, route=self.rules.resolve(f"{self.prefix}.{name}"), impl=self.impl, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=nnx.initializers.normal(self.config.init_std),
        kernel_sharding=fsdp_sharding((d_in, d_out)), rngs=self.rngs)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None, *, layer: int = 0
              ) -> jax.Array:
  """Causal `jax.nn.dot_product_attention` of q [B, T, H, Dh] with k, v [B, T, K, Dh] (GQA).

  implementation "auto": cuDNN's fused flash attention when compiling for a GPU and q is bf16/f16 with a head
  dim that is a multiple of 8 up to `cudnn_head_dim_max()` (what cuDNN's kernel takes: 256 on Hopper, else 128),
  else XLA's, which materializes the [B, H, T, T] scores (out of memory at 1B, seq 2048 on an H200). Where cuDNN
  turns the call down while tracing (no cuDNN, too old a version) it warns and falls back to XLA. Other values
  pass through.
  layer: the block's index (static), which keeps each block's cuDNN call its own under deterministic ops
  (`_cudnn_attention`).
  """
  if implementation == "auto":
    if platform.compiles_for_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) and cudnn_takes_head_dim(q.shape[-1]):
      try:
        return _cudnn_attention(q, k, v, layer)
      except (RuntimeError, ValueError, NotImplementedError) as e:
        warnings.warn(f"cuDNN attention unavailable ({e}); using XLA's attention", stacklevel=2)
    implementation = "xla"
  if implementation == "cudnn":
    return _cudnn_attention(q, k, v, layer)
  if q.dtype == jnp.float16 and not platform.compiles_for_gpu():
    # XLA:CPU has no float16 product with a float32 result, which JAX's XLA attention asks for: a jitted call
    # fails ("precision 'F16_F16_F32' is not supported"), so it runs in float32 and rounds its output once.
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation).astype(jnp.float16)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def cudnn_head_dim_max() -> int:
  """The largest head dim cuDNN's flash attention takes (bf16/f16, a multiple of 8), by JAX's own check of the
  call: 256 where the default backend is a CUDA GPU of compute capability 9.0 (Hopper) or later, else 128. When a
  GPU program is compiled on a machine without one (`platform.compiles_for_gpu` through an abstract mesh) no
  capability can be read, and it is the conservative 128, as JAX's check of the call is there."""
  return 256 if cudnn_attention.check_compute_capability("9.0") else 128


def cudnn_takes_head_dim(head_dim: int) -> bool:
  """Whether cuDNN's flash attention (bf16/f16) takes `head_dim`: a multiple of 8 up to `cudnn_head_dim_max()`.
  The rule `attention` "auto" goes by and `check_cudnn_head_dim` refuses "cudnn" by."""
  return head_dim % 8 == 0 and head_dim <= cudnn_head_dim_max()


def check_cudnn_head_dim(head_dim: int, what: str) -> None:
  """A ValueError starting with `what` (the setting that asks for cuDNN's attention) where cuDNN's flash
  attention does not take `head_dim` (`cudnn_takes_head_dim`): train and bench check implementation "cudnn"
  before any work, where its first call would fail only when traced."""
  if not cudnn_takes_head_dim(head_dim):
    raise ValueError(f"{what} takes a head_dim that is a multiple of 8 up to {cudnn_head_dim_max()} on this GPU "
                     f"(cuDNN's flash attention), not head_dim={head_dim}")


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: int) -> jax.Array:
  """`jax.nn.dot_product_attention(..., implementation="cudnn")`, causal; under deterministic ops
  (`platform.deterministic_ops`) the same cuDNN call made through JAX's cuDNN module with the dropout seed set to
  the layer: XLA:GPU in JAX 0.11.2 asks cuDNN for its deterministic backward only for the first of several
  identical backward calls (two blocks of one shape), and the program then fails when it starts (IndexError
  `raw_hash_map<>::at`: openxla/xla#46500). A seed per layer makes the calls differ; without dropout it is
  never read, so the numbers are the same."""
  if not platform.deterministic_ops():
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  return cudnn_attention.dot_product_attention(q, k, v, scale=1.0 / np.sqrt(q.shape[-1]),
                                               mask_type=cudnn_attention.MaskType.CAUSAL, seed=layer)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with RoPE; q, k, v, o are FP4Linear.

  The score and value products run in `dtype` (bf16) through `jax.nn.dot_product_attention`, never FP4.
  """

  def __init__(self, config: LlamaConfig, *, layer: int, rules: RouteRules, rngs: nnx.Rngs, impl: Impl = Impl(),
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    self.layer = layer
    self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
    self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_scaling
    self.implementation = config.attention_impl
    make = _Linears(config, rules, impl, f"layers.{layer}.attn", rngs, dtype, param_dtype)
    d, hd = config.dim, config.head_dim
    self.q = make("q", d, config.n_heads * hd)
    self.k = make("k", d, config.n_kv_heads * hd)
    self.v = make("v", d, config.n_kv_heads * hd)
    self.o = make("o", config.n_heads * hd, d)
    # One product for q, k, v where they share a route (`linear.fused_call`); static, part of the graph.
    self.fused = config.fuse_linears and linear.fusable([self.q, self.k, self.v])

  def __call__(self, x: jax.Array, positions: jax.Array, *, key: jax.Array | None = None,
               layer: int | jax.Array | None = None) -> jax.Array:
    """`layer` overrides `self.layer` in the key indices (a traced int32 when blocks run under a scan)."""
    layer = self.layer if layer is None else layer
    keys = _fold(key, layer, "attn")
    b, t, _ = x.shape  # [B, T, D]
    if self.fused:  # the product draws q's key
      q, k, v = linear.fused_call([self.q, self.k, self.v], x, key=keys["q"])
    else:
      q, k, v = (self.q(x, key=keys["q"]), self.k(x, key=keys["k"]), self.v(x, key=keys["v"]))
    q = q.reshape(b, t, self.n_heads, self.head_dim)  # [B, T, H, Dh]
    k = k.reshape(b, t, self.n_kv_heads, self.head_dim)  # [B, T, K, Dh]
    v = v.reshape(b, t, self.n_kv_heads, self.head_dim)  # [B, T, K, Dh]
    freqs = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)  # [Dh/2], constants
    q = apply_rope(q, positions, freqs)
    k = apply_rope(k, positions, freqs)
    out = attention(q, k, v, self.implementation, layer=self.layer)
    return self.o(out.reshape(b, t, self.n_heads * self.head_dim), key=keys["o"])  # [B, T, D]


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); the elementwise part in float32 (`numerics.produced.swiglu_pair`)."""

  def __init__(self, config: LlamaConfig, *, layer: int, rules: RouteRules, rngs: nnx.Rngs, impl: Impl = Impl(),
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    self.layer = layer
    make = _Linears(config, rules, impl, f"layers.{layer}.mlp", rngs, dtype, param_dtype)
    self.gate = make("gate", config.dim, config.ffn_dim)
    self.up = make("up", config.dim, config.ffn_dim)
    self.down = make("down", config.ffn_dim, config.dim)
    self.fused = config.fuse_linears and linear.fusable([self.gate, self.up])  # as in `Attention`

  def __call__(self, x: jax.Array, *, key: jax.Array | None = None,
               layer: int | jax.Array | None = None) -> jax.Array:
    """`layer` overrides `self.layer` in the key indices, as in `Attention`."""
    layer = self.layer if layer is None else layer
    keys = _fold(key, layer, "mlp")
    if self.fused:  # the product draws gate's key; down's quantizers may compute SwiGLU themselves (`Produced`)
      h = produced.Produced("swiglu", (linear.fused_product([self.gate, self.up], x, key=keys["gate"]),))
    else:
      h = produced.swiglu_pair(self.gate(x, key=keys["gate"]), self.up(x, key=keys["up"]))
    if h.dtype != x.dtype:
      h = produced.value(h).astype(x.dtype)
    return self.down(h, key=keys["down"])  # [B, T, D]


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, config: LlamaConfig, *, layer: int, rules: RouteRules, rngs: nnx.Rngs, impl: Impl = Impl(),
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
    self.attn_norm = RMSNorm(config.dim, eps=config.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.attn = Attention(config, layer=layer, rules=rules, rngs=rngs, impl=impl, dtype=dtype,
                          param_dtype=param_dtype)
    self.mlp_norm = RMSNorm(config.dim, eps=config.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.mlp = MLP(config, layer=layer, rules=rules, rngs=rngs, impl=impl, dtype=dtype, param_dtype=param_dtype)

  def __call__(self, x: jax.Array, positions: jax.Array, *, key: jax.Array | None = None,
               layer: int | jax.Array | None = None) -> jax.Array:
    """`layer`: the block index for the key indices if not this block's own (a traced int32 under a scan)."""
    x = x + self.attn(self.attn_norm(x), positions, key=key, layer=layer)  # [B, T, D]
    return x + self.mlp(self.mlp_norm(x), key=key, layer=layer)  # [B, T, D]
