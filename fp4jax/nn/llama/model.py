"""The Llama model: embedding, a Python list of blocks, final RMSNorm, lm_head.

Blocks are a plain `nnx.List` of modules, not an `nnx.scan` over stacked weights: each block owns its own
FP4Linear modules with possibly different routes (first/last N blocks in bf16), which a scan over one
stacked block could not express without per-layer route switches. The cost is compile time linear in depth.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax.nn.linear import FP4Linear, sharded_init
from fp4jax.nn.llama.config import LlamaConfig
from fp4jax.nn.llama.layers import LINEARS_PER_BLOCK, Block, RMSNorm, fsdp_sharding
from fp4jax.nn.rules import RouteRules


class Llama(nnx.Module):
  """Decoder-only Llama with FP4 dense layers routed per module path by `rules`.

  Random keys: pass one key per step; block l's linears get fold_in(key, 7l + j) (see
  `layers.linear_index`), the lm_head fold_in(key, 7 * n_layers). Parameters carry FSDP sharding metadata
  ("fsdp" on the largest dim of each matrix, the vocab dim of the embedding), read it with
  `nnx.get_partition_spec(nnx.state(model))`.
  """

  def __init__(self, config: LlamaConfig, *, rules: RouteRules, rngs: nnx.Rngs, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32):
    self.config = config
    embed_init = sharded_init(nnx.initializers.normal(config.init_std), ("fsdp", None))
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=embed_init, rngs=rngs)  # embedding [V, D]
    self.layers = nnx.List([
        Block(config, layer=i, rules=rules, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        for i in range(config.n_layers)
    ])
    self.norm = RMSNorm(config.dim, eps=config.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if config.tie_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = FP4Linear(
          config.dim, config.vocab_size, route=rules.resolve("lm_head"), dtype=dtype, param_dtype=param_dtype,
          kernel_init=nnx.initializers.normal(config.init_std),
          kernel_sharding=fsdp_sharding((config.dim, config.vocab_size)), out_dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] float32. `key`: one random key per step (keyed routes)."""
    b, t = tokens.shape
    if t > self.config.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds {self.config.max_seq_len=}")
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    x = self.embed(tokens)  # [B, T, D]
    for block in self.layers:
      x = block(x, positions, key=key)
    x = self.norm(x)
    if self.lm_head is None:
      # embed.attend would round the logits to bf16 (~0.4% of each, before the softmax); accumulate and
      # return them in float32 from the same bf16 operands instead.
      table = self.embed.embedding[...].astype(x.dtype)  # [V, D]
      logits = jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)  # [B, T, V]
    else:
      head_index = LINEARS_PER_BLOCK * self.config.n_layers
      head_key = None if key is None else jax.random.fold_in(key, head_index)
      logits = self.lm_head(x, key=head_key)  # [B, T, V]
    return logits.astype(jnp.float32)

  def routes(self) -> dict[str, str]:
    """{dotted module path: route name} of every FP4Linear, for logging which layers run in FP4."""
    return {".".join(map(str, path)): module.route.name
            for path, module in nnx.iter_graph(self) if isinstance(module, FP4Linear)}
