"""The Llama model: embedding, the transformer blocks, final RMSNorm, lm_head.

Each block has its own FP4Linear routes (first/last N blocks in bf16). Unrolled (the default), the blocks are a
plain `nnx.List` of modules, parameters `layers.{i}.*`, and `__call__` calls them one after the other. With
`scan_layers=True` each run of consecutive blocks with identical routes (`Llama.block_groups`) is held as ONE
block whose parameters carry a leading layer axis, `stacks.{g}.*` ([L_g, ...], as MaxText holds scanned
layers), and runs as one loop over them (`fp4jax.nn.scan.run_layers`: a scan that writes what the backward
reads into uninitialized stacks, not zero-filled ones as `jax.lax.scan`'s). The loop reads each layer's slice
of the float32 master weights as the dtype its products use (`run_layers`' `read_as`), so a step makes no cast
copy of the stacks and keeps none for its backward. Compile time then grows with the number of distinct runs,
not with depth. Holding the parameters stacked replaced stacking per-layer parameters inside every step (a
cast and a concatenation of every kernel), which made scanned steps slower on an H200 (docs/BENCHMARKS.md,
"H200 session of 2026-12-04, 11:55").

The two layouts hold the same numbers: a scanned model is initialized as the unrolled one and then stacked, and
`unstacked_params` / `stacked_params` convert a state (parameters, gradients, optimizer moments as pure dicts)
between them (`copy_params` between two models). Scanned and unrolled give bit-identical numbers on the CPU
under `jax.jit` (the layer index reaches the per-linear keys as a traced loop index). Called eagerly they do
not: the unrolled blocks then run op by op and round otherwise than compiled ones, while a scanned run's loop
is compiled either way. On an H200, XLA fused a bf16 unrolled step differently (a Llama-30M loss differed in its
6th digit, docs/BENCHMARKS.md). A reduction over the whole state, such as optax's global gradient norm, sums a
stacked leaf in another float32 order than per-layer ones.

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
import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax import dot, platform
from fp4jax.impl import Impl
from fp4jax.nn import linear, rules as rules_lib, scan as scan_lib
from fp4jax.nn.linear import FP4Linear, sharded_init
from fp4jax.nn.llama.config import LlamaConfig
from fp4jax.nn.llama.layers import Block, RMSNorm, fsdp_sharding, linear_index
from fp4jax.nn.rules import RouteRules
from fp4jax.numerics import prng
from fp4jax.numerics.spec import float_dtype


LAYERS, STACKS = "layers", "stacks"  # the state's entries of unrolled and stacked blocks


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
  (`RouteRules.rules`, not the recipe's fallback) that decides no linear is a ValueError (`RouteRules.unused`),
  and so are rules made for another depth (`RouteRules.check_depth`).

  Random keys: pass one key per step; block l's linears get prng.fold_in(key, 7l + j) (see
  `layers.linear_index`), the lm_head prng.fold_in(key, 7 * n_layers). Parameters carry FSDP sharding metadata
  ("fsdp" on the largest dim of each matrix, the vocab dim of the embedding; a stacked parameter's layer axis is
  not sharded), read it with `nnx.get_partition_spec(nnx.state(model))`. `scan_layers`: hold each run of
  same-route blocks stacked and run it as one loop (`scan.run_layers`) under the checkpoint policy
  `scan_policy` (module docstring; compile time ~ number of distinct runs, not depth); False (default) unrolls
  them, with the same bits on the CPU under jit (module docstring); "auto" scans when any block runs a quantized
  route (whose unrolled steps compile for minutes: a Llama-1B mxfp4 step did not finish in 290 s, scanned it
  took 11 s) and unrolls bf16-only models. `block_groups`: the layer ranges that run as one loop (every block
  alone when unrolled).
  """

  def __init__(self, config: LlamaConfig, *, rules: RouteRules, rngs: nnx.Rngs, impl: Impl = Impl(),
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32, scan_layers: bool | str = False,
               scan_policy: SavePolicy = SCAN_SAVES):
    if not isinstance(config, LlamaConfig):
      raise TypeError(f"Llama takes a LlamaConfig (LlamaConfig.preset(name), LlamaConfig(...)), got {config!r}")
    if not isinstance(rules, RouteRules):
      raise TypeError(f"Llama's rules= takes a RouteRules (RouteRules.standard(route, n_layers=...), "
                      f"RouteRules.parse([...])), got {rules!r}")
    if scan_layers not in (True, False, "auto"):
      raise ValueError(f"scan_layers takes True, False or 'auto', got {scan_layers!r}")
    if scan_policy is not None and not callable(scan_policy):  # a name failed in the first scanned call only
      raise TypeError(f"Llama's scan_policy= takes a jax.checkpoint policy such as SCAN_POLICIES[name] (names: "
                      f"{list(SCAN_POLICIES)}), got {scan_policy!r}")
    # Before anything is built: the blocks' FP4Linears would refuse them only after the [V, D] embedding.
    float_dtype(param_dtype, "Llama's param_dtype=")
    dot.check_out_dtype(dtype, "Llama's dtype=")
    rules.check_depth(config.n_layers)
    self.config = config
    self.scan_policy = scan_policy
    embed_init = sharded_init(nnx.initializers.normal(config.init_std), ("fsdp", None))
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=embed_init, rngs=rngs)  # embedding [V, D]
    build = lambda i, r: Block(config, layer=i, rules=rules, rngs=r, impl=impl, dtype=dtype, param_dtype=param_dtype)
    blocks, drawn = _drawn_blocks(config.n_layers, build, rngs)  # abstract blocks and their stacked parameters
    self.norm = RMSNorm(config.dim, eps=config.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if scan_layers == "auto":  # scan where a block runs an FP4 (or FP8) route: see the class docstring
      scan_layers = any(not module.route.high_precision for block in blocks for _, module in nnx.iter_graph(block)
                        if isinstance(module, FP4Linear))
    self.scan_layers = scan_layers
    self.block_groups = _runs(blocks) if scan_layers else tuple(range(i, i + 1) for i in range(len(blocks)))
    if scan_layers:
      self.layers = nnx.data(None)
      self.stacks = nnx.List([_stacked(blocks, drawn, g) for g in self.block_groups])
    else:
      self.layers = nnx.List(_per_layer(blocks, drawn))
      self.stacks = nnx.data(None)
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
    if key is not None:  # derived per linear before any fp4_dot sees it: a float or int would seed silently
      prng.check_key(key, "Llama")
    if not hasattr(tokens, "dtype") or tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      got = f"{tokens.dtype}{list(tokens.shape)}" if hasattr(tokens, "dtype") else f"a {type(tokens).__name__}"
      raise ValueError(f"Llama takes tokens [B, T] of an integer dtype, got {got}")
    _, t = tokens.shape
    if t > self.config.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds {self.config.max_seq_len=}")
    if platform.splits_explicit_axes():
      # Under a mesh of Explicit axes the embedding's gather, attention and the scan's stacks would each need
      # their output shardings spelt out: the model runs with the axes Auto instead, as fp4_dot does, its
      # parameters passed in (a closed-over array of the Explicit mesh would clash with the Auto one).
      graphdef, state = nnx.split(self)
      run = lambda state, tokens, key: nnx.merge(graphdef, state)._logits(tokens, key)
      spec = jax.sharding.PartitionSpec(*jax.typeof(tokens).sharding.spec, None)
      return jax.sharding.auto_axes(run, out_sharding=spec)(state, tokens, key)
    return self._logits(tokens, key)

  def _logits(self, tokens: jax.Array, key: jax.Array | None) -> jax.Array:
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    x = self.embed(tokens)  # [B, T, D]
    for g, group in enumerate(self.block_groups):
      # The barrier rounds x to its dtype at every group boundary as the scan carry does at every block
      # (XLA's excess precision could otherwise keep it in float32 across an unrolled boundary): scanned
      # and unrolled runs then give bit-identical numbers (under jit: module docstring).
      if self.scan_layers:
        x = self._run_stack(self.stacks[g], group, x, positions, key)
      else:
        x = self.layers[group.start](x, positions, key=key)
      x = jax.lax.optimization_barrier(x)
    x = self.norm(x)
    if self.lm_head is None:
      # embed.attend would round the logits to bf16 (~0.4% of each, before the softmax); accumulate and
      # return them in float32 from the same bf16 operands instead (the backward GEMMs stay bf16: fp4_dot).
      table = self.embed.embedding[...].astype(x.dtype)  # [V, D]
      logits = dot.fp4_dot(x, table.T, route="bf16", out_dtype=jnp.float32)  # [B, T, V]
    else:
      head_key = None if key is None else prng.fold_in(key, linear_index("lm_head", n_layers=self.config.n_layers))
      logits = self.lm_head(x, key=head_key)  # [B, T, V]
    return logits.astype(jnp.float32)

  def _run_stack(self, stack: Block, group: range, x: jax.Array, positions: jax.Array,
                 key: jax.Array | None) -> jax.Array:
    """x [B, T, D] through the blocks `group`, whose parameters `stack` holds stacked: a direct call of layer
    0's slice for one block, else a loop over the slices."""
    graphdef, state = nnx.split(stack)  # Its own `layer` (group.start) is overridden by the loop's index.
    if len(group) == 1:
      return nnx.merge(graphdef, jax.tree.map(lambda p: p[0], state))(x, positions, key=key)
    casts = _kernel_dtypes(stack)
    read_as = lambda path, _: casts.get(tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)))
    # Each stack enters the loop as [L, prod(shape)] and each layer's slice is reshaped back in the loop body.
    # A product reads its kernel transposed ([out, in], K-major); with the [L, in, out] stack as the loop's
    # operand, XLA laid the whole float32 stack out transposed, one more pass over it per step, instead of
    # transposing each layer's slice in the fusion that casts it (compiled H200 program, 2026-12-04).
    leaves, treedef = jax.tree.flatten(state)
    shapes = [p.shape[1:] for p in leaves]
    flat = jax.tree.unflatten(treedef, [p.reshape(p.shape[0], -1) for p in leaves])

    @functools.partial(jax.checkpoint, policy=self.scan_policy, prevent_cse=False)  # CSE is safe in a loop body
    def block(h, flat_state, invariants, layer):
      positions, key = invariants
      state = jax.tree.unflatten(treedef, [p.reshape(s) for p, s in zip(jax.tree.leaves(flat_state), shapes)])
      return nnx.merge(graphdef, state)(h, positions, key=key, layer=layer)

    return scan_lib.run_layers(block, x, flat, (positions, key), first_layer=group.start, read_as=read_as)

  def routes(self) -> dict[str, str]:
    """{dotted module path: route name} of every FP4Linear, for logging which layers run in FP4; a stacked
    block's linears are listed under each of its layers (`layers.{i}.*`), as an unrolled model names them."""
    out = {}
    for path, module in nnx.iter_graph(self):
      if isinstance(module, FP4Linear):
        names = ([(LAYERS, i, *path[2:]) for i in self.block_groups[path[1]]] if path[0] == STACKS else [path])
        out |= {".".join(map(str, name)): module.route.name for name in names}
    return out


def unstacked_params(pure: Any, groups: Sequence[range], take: Callable[[Any, int], Any] = operator.getitem) -> Any:
  """A scanned Llama's state as a pure dict (`nnx.to_pure_dict`: parameters, their gradients, an optimizer state
  holding moments of them) in the unrolled model's layout: every `stacks` entry, at whatever depth, split along
  its layer axis into `layers.{i}` for the layers i of `groups[g]` (`Llama.block_groups`) for its entry g.
  Everything else is kept as it is. `take(leaf, l)`: slice l of a stacked leaf (leaf[l]; another function for
  leaves that are not arrays, such as abstract ones)."""
  if not isinstance(pure, dict):
    return pure
  out = {k: unstacked_params(v, groups, take) for k, v in pure.items() if k != STACKS}
  if STACKS in pure:
    out[LAYERS] = {i: jax.tree.map(lambda p, l=i - group.start: take(p, l), pure[STACKS][g])
                   for g, group in enumerate(groups) for i in group}
  return out


def stacked_params(pure: Any, groups: Sequence[range]) -> Any:
  """The inverse of `unstacked_params`: `layers.{i}` entries, at whatever depth, stacked into `stacks.{g}`."""
  if not isinstance(pure, dict):
    return pure
  out = {k: stacked_params(v, groups) for k, v in pure.items() if k != LAYERS}
  if LAYERS in pure:
    out[STACKS] = {g: jax.tree.map(lambda *p: jnp.stack(p), *(pure[LAYERS][i] for i in group))
                   for g, group in enumerate(groups)}
  return out


def copy_params(src: Llama, dst: Llama) -> None:
  """Sets every parameter of `dst` to `src`'s, whichever layout each holds its blocks in (scanned or unrolled,
  other route rules, so other groups), cast to the dtype of `dst`'s parameter (its `param_dtype`: float32 master
  weights copied into a bf16 model stay bf16 there). The two must have one config (shapes); raises ValueError
  otherwise."""
  if src.config != dst.config:
    raise ValueError(f"copy_params needs two models of one config: {src.config} != {dst.config}")
  pure = nnx.to_pure_dict(nnx.state(src, nnx.Param))
  if src.scan_layers:
    pure = unstacked_params(pure, src.block_groups)
  if dst.scan_layers:
    pure = stacked_params(pure, dst.block_groups)
  state = nnx.state(dst, nnx.Param)
  pure = jax.tree.map(lambda p, d: p if p.dtype == d.dtype else p.astype(d.dtype), pure, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(dst, state)


def weight_decay_mask(params: Any) -> Any:
  """True for the matrices of a Llama state (embedding, linear kernels), False for the norm scales: a leaf is a
  matrix when it has 2 axes besides a stacked block's layer axis (`stacks.*`). For optax's `mask=`."""
  def matrix(path, p):
    stacked = any(getattr(k, "key", getattr(k, "name", None)) == STACKS for k in path)
    return p.ndim - stacked >= 2
  return jax.tree_util.tree_map_with_path(matrix, params)


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

  A scanned run reads each layer's kernel slice in that dtype (`run_layers`' `read_as`) rather than as the
  float32 master weight: the product reads only the cast, so the numbers and gradients are the same (the cast's
  backward converts the bf16 cotangent, wherever it sits), while the loop's gradient stacks hold half the bytes."""
  return {(*map(str, path), "kernel"): module.dtype for path, module in nnx.iter_graph(block)
          if isinstance(module, FP4Linear)}


def _runs(blocks: list[Block]) -> tuple[range, ...]:
  """Runs of consecutive layer indices whose blocks can share one compiled body (`_block_signature`)."""
  groups: list[range] = []
  previous = None
  for i, block in enumerate(blocks):
    signature = _block_signature(block)
    if groups and signature == previous:
      groups[-1] = range(groups[-1].start, i + 1)
    else:
      groups.append(range(i, i + 1))
    previous = signature
  return tuple(groups)


def _drawn_blocks(n: int, build: Callable[[int, nnx.Rngs], Block], rngs: nnx.Rngs) -> tuple[list[Block], Any]:
  """The parameters of `[build(i, rngs) for i in range(n)]` bit for bit, drawn by one vmapped draw per parameter
  over the blocks rather than block by block: (the blocks, abstract: their graphs and routes; their parameters,
  one nnx.State with a leading block axis), which `_per_layer` and `_stacked` assemble.

  Block i's FP4Linears take their keys from `rngs.params` as the loop would: fold_in(key, count), the stream's
  count starting at c0 + i * P (P keys per block, one per kernel and bias). Drawn block by block inside a jitted
  initializer, every draw was a kernel of its own with its key folded in as constants: a Llama-1B state took 21 s
  to compile on an H100 (docs/BENCHMARKS.md, "Session of 2026-12-06, 16:12 UTC"). Blocks whose states differ in
  structure (none of the Llama's do) are built one by one: (the blocks, None)."""
  blocks = [nnx.eval_shape(lambda i=i: build(i, nnx.Rngs(0))) for i in range(n)]
  treedef = jax.tree.structure(nnx.state(blocks[0]))
  if any(jax.tree.structure(nnx.state(block)) != treedef for block in blocks):
    return [build(i, rngs) for i in range(n)], None
  stream = rngs.params
  keys = sum(1 + (module.bias is not None)  # FP4Linear.__init__ takes a key for its kernel and one for its bias
             for _, module in nnx.iter_graph(blocks[0]) if isinstance(module, FP4Linear))
  start = stream.count[...]

  def one(count):
    own = nnx.Rngs(params=stream.key[...])
    own.params.count[...] = count
    return nnx.state(build(0, own))

  drawn = jax.vmap(one)(start + keys * jnp.arange(n, dtype=start.dtype))
  stream.count[...] = start + n * keys
  return blocks, drawn


def _per_layer(blocks: list[Block], drawn: Any) -> list[Block]:
  """`_drawn_blocks`' blocks, each with its own parameters. Each is cut from the stack at an index XLA cannot
  fold (an optimization barrier), so that every block's cut is one kernel per parameter shape rather than one per
  block (the same copy; a 1B initializer compiled for an H200 held 100 distinct kernels with static slices, 40
  so)."""
  if drawn is None:
    return blocks

  def cut(i):
    index = jax.lax.optimization_barrier(jnp.int32(i))
    return jax.tree.map(lambda stack: jax.lax.dynamic_index_in_dim(stack, index, keepdims=False), drawn)
  return [nnx.merge(nnx.graphdef(block), cut(i)) for i, block in enumerate(blocks)]


def _stacked(blocks: list[Block], drawn: Any, group: range) -> Block:
  """One block (the first of `group`'s modules and routes) holding the parameters of `blocks[group]` stacked
  along a new leading layer axis, unsharded (its sharding names get a leading None): `_drawn_blocks`' stack
  sliced, or the blocks' parameters stacked where they were built one by one."""
  if drawn is None:
    state = jax.tree.map(lambda *p: jnp.stack(p), *(nnx.state(blocks[i]) for i in group))
  else:
    state = jax.tree.map(lambda stack: stack[group.start:group.stop], drawn)
  stack = nnx.merge(nnx.graphdef(blocks[group.start]), state)
  for _, variable in nnx.iter_graph(stack):
    if isinstance(variable, nnx.Variable) and variable.has_metadata("out_sharding"):
      names = variable.get_metadata()["out_sharding"]
      if names is not None:
        variable.set_metadata("out_sharding", (None, *names))
  return stack


def _block_signature(block: Block) -> tuple[Any, ...]:
  """What must match for blocks to run as one scan body: the route of each FP4Linear (by path within the
  block) and the state's tree structure, shapes and dtypes. The static `layer` index may differ."""
  routes = tuple((path, module.route) for path, module in nnx.iter_graph(block)
                 if isinstance(module, FP4Linear))
  leaves, treedef = jax.tree.flatten(nnx.state(block))
  return routes, treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)
