"""The Llama model: embedding, a Python list of blocks, final RMSNorm, lm_head.

Blocks are a plain `nnx.List` of modules (parameters `layers.{i}.*`), each with its own FP4Linear routes
(first/last N blocks in bf16). `__call__` unrolls them by default. With `scan_layers=True` it runs each run of
consecutive blocks with identical routes as one loop over their parameters stacked inside the call
(`fp4jax.nn.scan.run_layers`: a scan that writes what the backward reads into uninitialized stacks, not
zero-filled ones as `jax.lax.scan`'s; FP4Linear kernels stacked already cast to the bf16 their products read,
`_kernel_dtypes`): compile time then grows with the number of distinct runs, not with depth, the parameter tree
is unchanged, and gradients flow back to each block through the stack. Scanned and unrolled give bit-identical
numbers on the CPU (the layer index reaches the per-linear keys as a traced loop index); on an H200, XLA fused
a bf16 unrolled step differently (a Llama-30M loss differed in its 6th digit, docs/BENCHMARKS.md).

What a scanned body saves for the backward crosses the loop boundary, so it is written to memory, where an
unrolled program lets XLA fuse a cheap producer into its backward consumer instead. Saving everything (JAX's
default) kept every float32 intermediate of RMSNorm and SwiGLU: Llama-1B at 8 x 2048 tokens on an H200 needed
twice the memory of the unrolled step and ran 20% slower (docs/BENCHMARKS.md). The scanned body is therefore
a `jax.checkpoint` under a `SavePolicy` (`SCAN_POLICIES`). "outputs" (the default) keeps the linears' outputs,
fp4_dot's quantized residuals and cuDNN attention's output and statistics, and recomputes the elementwise rest
(norms, RoPE, SiLU) in the backward, where it fuses into the gradient's own passes. "operands" also keeps the
bf16 operands of every linear's product (inputs and cast weights), which only a high-precision route's
backward reads (not measured on a GPU). Saved outputs need XLA's dynamic-slice fusion off (the apps' XLA flags,
`fp4jax.platform`): it cloned each GEMM whose output is also saved into a fusion writing the residual stack.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax import dot
from fp4jax.impl import Impl
from fp4jax.nn import linear, rules as rules_lib, scan as scan_lib
from fp4jax.nn.linear import FP4Linear, sharded_init
from fp4jax.nn.llama.config import LlamaConfig
from fp4jax.nn.llama.layers import LINEARS_PER_BLOCK, Block, RMSNorm, fsdp_sharding
from fp4jax.nn.rules import RouteRules
from fp4jax.numerics import prng


@dataclasses.dataclass(frozen=True)
class SavePolicy:
  """A `jax.checkpoint` policy: save the values tagged with one of `names`, and the outputs of primitives
  whose name starts with one of `primitive_prefixes`; recompute everything else in the backward."""

  names: frozenset[str]
  primitive_prefixes: tuple[str, ...]

  def __call__(self, prim, *_, **params) -> bool:
    if prim.name == "name":  # jax.ad_checkpoint.checkpoint_name
      return params["name"] in self.names
    return prim.name.startswith(self.primitive_prefixes)


# What a scanned block keeps for its backward (module docstring): every FP4Linear output, fp4_dot's quantized
# residuals, and cuDNN flash attention's forward outputs (its output and softmax statistics, which its backward
# reads; recomputing them would re-run the attention forward).
SCAN_SAVES = SavePolicy(frozenset({linear.OUTPUT, dot.RESIDUALS}), ("dot_product_attention_fwd",))
# By name (`Llama(scan_policy=...)`, the train config's model.scan_saves, bench step's --scan-saves).
SCAN_POLICIES: dict[str, SavePolicy] = {
    "outputs": SCAN_SAVES,
    "operands": dataclasses.replace(SCAN_SAVES, names=SCAN_SAVES.names | {linear.INPUT, linear.KERNEL}),
}


class Llama(nnx.Module):
  """Decoder-only Llama with FP4 dense layers routed per module path by `rules`; one of the user's rules
  (`RouteRules.rules`, not the recipe's fallback) that decides no linear is a ValueError (`RouteRules.unused`).

  Random keys: pass one key per step; block l's linears get prng.fold_in(key, 7l + j) (see
  `layers.linear_index`), the lm_head prng.fold_in(key, 7 * n_layers). Parameters carry FSDP sharding metadata
  ("fsdp" on the largest dim of each matrix, the vocab dim of the embedding), read it with
  `nnx.get_partition_spec(nnx.state(model))`. `scan_layers`: run each run of same-route blocks as one
  loop (`scan.run_layers`) under the checkpoint policy `scan_policy` (compile time ~ number of distinct runs,
  not depth; the bf16 step of 12 Llama-3-8B blocks 8% slower than unrolled on an H200, docs/BENCHMARKS.md);
  False (default) unrolls them, with the same bits on the CPU; "auto" scans when any block runs a quantized
  route (whose unrolled steps compile for minutes: a Llama-1B mxfp4 step did not finish in 290 s, scanned it
  took 11 s) and unrolls bf16-only models.
  """

  def __init__(self, config: LlamaConfig, *, rules: RouteRules, rngs: nnx.Rngs, impl: Impl = Impl(),
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32, scan_layers: bool | str = False,
               scan_policy: SavePolicy = SCAN_SAVES):
    if scan_layers not in (True, False, "auto"):
      raise ValueError(f"scan_layers takes True, False or 'auto', got {scan_layers!r}")
    self.config = config
    self.scan_policy = scan_policy
    embed_init = sharded_init(nnx.initializers.normal(config.init_std), ("fsdp", None))
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=embed_init, rngs=rngs)  # embedding [V, D]
    self.layers = nnx.List([
        Block(config, layer=i, rules=rules, rngs=rngs, impl=impl, dtype=dtype, param_dtype=param_dtype)
        for i in range(config.n_layers)
    ])
    self.norm = RMSNorm(config.dim, eps=config.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if scan_layers == "auto":  # scan where a block runs an FP4 (or FP8) route: see the class docstring
      scan_layers = any(not module.route.high_precision for _, module in nnx.iter_graph(self.layers)
                        if isinstance(module, FP4Linear))
    self.scan_layers = scan_layers
    if config.tie_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = FP4Linear(
          config.dim, config.vocab_size, route=rules.resolve("lm_head"), impl=impl, dtype=dtype,
          param_dtype=param_dtype,
          kernel_init=nnx.initializers.normal(config.init_std),
          kernel_sharding=fsdp_sharding((config.dim, config.vocab_size)), out_dtype=jnp.float32, rngs=rngs)
    _check_rules_used(rules, list(self.routes()), config.n_layers)

  def __call__(self, tokens: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] float32. `key`: one random key per step (keyed routes)."""
    b, t = tokens.shape
    if t > self.config.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds {self.config.max_seq_len=}")
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    x = self.embed(tokens)  # [B, T, D]
    for group in self._block_groups():
      # The barrier rounds x to its dtype at every group boundary as the scan carry does at every block
      # (XLA's excess precision could otherwise keep it in float32 across an unrolled boundary): scanned
      # and unrolled runs then give bit-identical numbers.
      x = jax.lax.optimization_barrier(self._run_blocks(group, x, positions, key))
    x = self.norm(x)
    if self.lm_head is None:
      # embed.attend would round the logits to bf16 (~0.4% of each, before the softmax); accumulate and
      # return them in float32 from the same bf16 operands instead (the backward GEMMs stay bf16: fp4_dot).
      table = self.embed.embedding[...].astype(x.dtype)  # [V, D]
      logits = dot.fp4_dot(x, table.T, route="bf16", out_dtype=jnp.float32)  # [B, T, V]
    else:
      head_index = LINEARS_PER_BLOCK * self.config.n_layers
      head_key = None if key is None else prng.fold_in(key, head_index)
      logits = self.lm_head(x, key=head_key)  # [B, T, V]
    return logits.astype(jnp.float32)

  def _block_groups(self) -> list[range]:
    """Runs of consecutive layer indices whose blocks can share one compiled body (same routes and state
    structure); every block alone when `scan_layers` is off."""
    if not self.scan_layers:
      return [range(i, i + 1) for i in range(len(self.layers))]
    groups: list[range] = []
    previous = None
    for i, block in enumerate(self.layers):
      signature = _block_signature(block)
      if groups and signature == previous:
        groups[-1] = range(groups[-1].start, i + 1)
      else:
        groups.append(range(i, i + 1))
      previous = signature
    return groups

  def _run_blocks(self, group: range, x: jax.Array, positions: jax.Array, key: jax.Array | None) -> jax.Array:
    """x [B, T, D] through blocks `group`: a direct call for one block, else a loop over stacked params."""
    if len(group) == 1:
      return self.layers[group.start](x, positions, key=key)
    graphdef = nnx.graphdef(self.layers[group.start])  # Its own `layer` is overridden by the loop's index.
    states = [nnx.state(self.layers[i]) for i in group]
    casts = _kernel_dtypes(self.layers[group.start])

    def stack(path, *leaves):  # [L, ...]; an FP4Linear kernel already in the dtype its product reads
      dtype = casts.get(tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)))
      return jnp.stack([leaf.astype(dtype) for leaf in leaves] if dtype else leaves)

    stacked = jax.tree_util.tree_map_with_path(stack, *states)

    @functools.partial(jax.checkpoint, policy=self.scan_policy, prevent_cse=False)  # CSE is safe in a loop body
    def block(h, state, invariants, layer):
      positions, key = invariants
      return nnx.merge(graphdef, state)(h, positions, key=key, layer=layer)

    return scan_lib.run_layers(block, x, stacked, (positions, key), first_layer=group.start)

  def routes(self) -> dict[str, str]:
    """{dotted module path: route name} of every FP4Linear, for logging which layers run in FP4."""
    return {".".join(map(str, path)): module.route.name
            for path, module in nnx.iter_graph(self) if isinstance(module, FP4Linear)}


def _check_rules_used(rules: RouteRules, paths: list[str], n_layers: int) -> None:
  """An UnusedRulesError (a ValueError) naming the user's rules that decide no linear of the model
  (`RouteRules.unused`): a misspelt regex (`layer\\.` for `layers\\.`) would otherwise train every layer on the
  default route."""
  unused = rules.unused(paths)
  if unused:
    shown = [p for p in paths if not p.startswith("layers.") or p.startswith("layers.0.")]
    named = ", ".join(f"'{rules_lib.describe(r)}'" for r in unused)
    raise rules_lib.UnusedRulesError(
        f"route rules {named} decide the route of no linear: a regex must fully match a dotted module path, and "
        f"the first rule that does wins; the model's linears are {shown} and the same in each block up to "
        f"layers.{n_layers - 1}")


def _kernel_dtypes(block: Block) -> dict[tuple[str, ...], Any]:
  """{state path of each FP4Linear kernel in `block`: the dtype its product casts it to (`FP4Linear.dtype`)}.

  A scanned run stacks each kernel in that dtype rather than as the float32 master weight: the product reads
  only the cast, so the numbers and gradients are the same (the cast's backward converts the bf16 cotangent,
  wherever it sits), while the stack, kept for the backward, holds half the bytes. On the H200 (12 Llama-3-8B
  blocks, mxfp4) that lowered peak memory by 3.8 GiB at the same step time (docs/BENCHMARKS.md)."""
  return {(*map(str, path), "kernel"): module.dtype for path, module in nnx.iter_graph(block)
          if isinstance(module, FP4Linear)}


def _block_signature(block: Block) -> tuple[Any, ...]:
  """What must match for blocks to run as one scan body: the route of each FP4Linear (by path within the
  block) and the state's tree structure, shapes and dtypes. The static `layer` index may differ."""
  routes = tuple((path, module.route) for path, module in nnx.iter_graph(block)
                 if isinstance(module, FP4Linear))
  leaves, treedef = jax.tree.flatten(nnx.state(block))
  return routes, treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)
