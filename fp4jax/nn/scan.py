"""A loop over stacked layers that saves what each layer's backward reads into uninitialized buffers.

`jax.lax.scan` (JAX 0.11.2) allocates every stacked output, and under AD every value its backward reads, as
zeros (`lax.empty2` broadcast) before the loop overwrites them slice by slice: a scanned Llama-1B mxfp4 step
compiled for the H200 wrote 12.8 GiB of zeros per step (docs/BENCHMARKS.md). `run_layers` has its own VJP
instead. Its forward is a `fori_loop` whose body takes `jax.vjp` of one layer and writes each residual of that
VJP into a `lax.empty` stack (on GPU one uninitialized allocation, no fill); its backward, a reversed loop,
rebuilds each layer's VJP from slice l of the stacks and writes the parameter gradients into `lax.empty`
stacks too. A residual that is one of the layer's inputs (a parameter slice, an invariant, the layer index)
is not stored: the backward takes it from where the forward did. Each layer's forward and backward are the
computations a `lax.scan` would run, with the same numbers (tests/nn/test_scan.py).

`read_as` casts each layer's parameter slice inside the loop (float32 master weights read as the bf16 their
products use): no cast copy of the whole stack is made or kept, and the loop's parameter gradients are stacked
in the dtype the layers read, converted to the stack's dtype once at the end.

Limits: reverse-mode only (no `jax.jvp` through it, as for any `custom_vjp`); invariants get no gradient.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from fp4jax import platform


class _Source(NamedTuple):
  """Where one leaf of a layer's VJP comes from in the backward: kind "stored" (stack `index`), "param"
  (leaf `index` of the layer's parameters), "invariant" (leaf `index` of the invariants), "layer" (the layer
  index), or "static" (the leaf itself, which is no traced array: a constant, or a marker object of JAX's
  VJP)."""

  kind: str
  index: Any


def _sources(leaves: list[Any], params: list[Any], invariants: list[Any], layer: jax.Array) -> list[_Source]:
  """Each VJP leaf's source. Inputs are found by identity: a VJP keeps the very arrays it was given."""
  inputs = {id(x): _Source("param", i) for i, x in enumerate(params)}
  inputs |= {id(x): _Source("invariant", i) for i, x in enumerate(invariants)}
  inputs[id(layer)] = _Source("layer", 0)
  stored: dict[int, int] = {}
  sources = []
  for leaf in leaves:
    if id(leaf) in inputs:
      sources.append(inputs[id(leaf)])
    elif isinstance(leaf, jax.core.Tracer):  # a value kept twice is stored once
      sources.append(_Source("stored", stored.setdefault(id(leaf), len(stored))))
    else:
      sources.append(_Source("static", leaf))
  return sources


def _slice(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _cast(leaves: list[Any], dtypes: list[Any]) -> list[Any]:
  return [x if d is None else x.astype(d) for x, d in zip(leaves, dtypes)]


def _write(stacks: list[jax.Array], values: list[jax.Array], i: jax.Array) -> list[jax.Array]:
  return [jax.lax.dynamic_update_index_in_dim(s, v, i, 0) for s, v in zip(stacks, values)]


def _empty(shape: tuple[int, ...], dtype: Any, spec: jax.sharding.PartitionSpec | None) -> jax.Array:
  """An uninitialized array partitioned by `spec` over the context's mesh (None: unspecified).

  `lax.empty` alone takes no mesh from the context, where the values computed in the loop do: under a mesh of
  explicit axes the two then differ, and `dynamic_update_slice` rejects writing one into the other."""
  mesh = jax.sharding.get_abstract_mesh()
  if spec is None or mesh.empty:
    return jax.lax.empty(shape, dtype)
  return jax.lax.empty(shape, dtype, out_sharding=jax.sharding.NamedSharding(mesh, spec))


def _spec(x: Any, stacked: bool = False) -> jax.sharding.PartitionSpec | None:
  """x's partition spec (an array or a ShapeDtypeStruct), or that of a stack of such values (`stacked`)."""
  sharding = x.sharding if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x).sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  return jax.sharding.PartitionSpec(None, *sharding.spec) if stacked else sharding.spec


def _differentiable(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _no_gradient(x: Any) -> np.ndarray:
  return np.zeros(np.shape(x), jax.dtypes.float0)


def run_layers(body: Callable[..., jax.Array], h: jax.Array, stacked: Any, invariants: Any = (), *,
               first_layer: int = 0, read_as: Callable[[Any, jax.Array], Any] | None = None) -> jax.Array:
  """h through L layers, h = body(h, params_l, invariants, layer) for l in range(L), where params_l is slice l
  of each leaf of `stacked` ([L, ...], one L >= 1 for every leaf: a ValueError otherwise) and `layer` =
  first_layer + l (a traced int32). Returns the last h.

  Differentiable in h and `stacked`; `invariants` (positions, a random key, ...) are passed to every layer
  and not differentiated, so they must be integer, boolean or key arrays (a TypeError otherwise). Each layer
  saves what `jax.vjp(body)` keeps: wrap `body` in `jax.checkpoint` with a policy to choose what that is.
  `read_as(path, leaf)`: the dtype `body` reads a leaf of `stacked` in (module docstring), or None for its own;
  `path` is the leaf's key path in `stacked`."""
  floats = [x for x in jax.tree.leaves(invariants) if _differentiable(x)]
  if floats:
    raise TypeError(f"run_layers: invariants get no gradient, so they take integer, boolean or key arrays; got "
                    f"{', '.join(str(jax.typeof(x)) for x in floats)} (pass a differentiable value in `stacked`, "
                    f"or close over it in `body` if it is a constant)")
  with_paths, params_tree = jax.tree_util.tree_flatten_with_path(stacked)
  lengths = {jax.tree_util.keystr(path): np.shape(x)[0] if np.ndim(x) else None for path, x in with_paths}
  if len(set(lengths.values())) != 1 or None in lengths.values() or 0 in lengths.values():
    # a shorter leaf would be read at a clamped index (its last slice again), silently
    sizes = ", ".join(f"{path}: {n}" for path, n in lengths.items()) or "no leaf"
    raise ValueError(f"run_layers takes stacked parameters with one leading layer axis of one length >= 1 in "
                     f"every leaf, got leading sizes {sizes} (None: a 0-d leaf)")
  length = next(iter(lengths.values()))
  dtypes = [None if read_as is None else read_as(path, x) for path, x in with_paths]
  read_leaves = lambda leaves, i: _cast(_slice(leaves, i), dtypes)  # layer i's parameters as `body` reads them
  read = lambda tree, i: jax.tree.unflatten(params_tree, read_leaves(params_tree.flatten_up_to(tree), i))
  # One layer's VJP structure and leaf sources, set while tracing the forward, read by the backward's trace.
  plan: dict[str, Any] = {}

  def layer(h, params, invariants, index):
    """One layer's output and the leaves of its VJP that must be stored, in stack order."""
    out, vjp = jax.vjp(lambda h, p: body(h, p, invariants, index), h, params)
    leaves, treedef = jax.tree.flatten(vjp)
    sources = _sources(leaves, jax.tree.leaves(params), jax.tree.leaves(invariants), index)
    if "sources" in plan and [s.kind for s in sources] != [s.kind for s in plan["sources"]]:
      raise AssertionError("run_layers: two traces of one layer's forward kept different residuals")
    plan.update(treedef=treedef, sources=sources)
    stored = {s.index: leaf for leaf, s in zip(leaves, sources) if s.kind == "stored"}
    return out, [stored[i] for i in range(len(stored))]

  @jax.custom_vjp
  def run(h, stacked, invariants):
    step = lambda i, h: body(h, read(stacked, i), invariants, first_layer + i)
    return jax.lax.fori_loop(0, length, step, h)

  def forward(h, stacked, invariants):
    first = jnp.int32(first_layer)  # traced, as in the loop, so that the same residuals are kept
    specs = []

    def traced_layer(*args):
      out, stored = layer(*args)
      # Each stack's sharding from the traced value: abstract shapes give some outputs none (cuDNN's attention,
      # a pure_callback) where the value has the context's mesh, and the stack must match what is written into it.
      specs[:] = [_spec(x, stacked=True) for x in stored]
      return out, stored

    # The layer is traced once: its jaxpr gives the stacks' shapes and is the loop's body, which replays it.
    # (Traced for the shapes and again in the loop, an FP4 Llama layer cost a tenth of a train step's trace:
    # docs/BENCHMARKS.md, "Session of 2026-12-08, 00:43 UTC".)
    closed, shapes = jax.make_jaxpr(traced_layer, return_shape=True)(h, read(stacked, 0), invariants, first)
    avals, out_tree, replay = shapes[1], jax.tree.structure(shapes), jax.extend.core.jaxpr_as_fun(closed)

    def step(i, carry):
      h, stacks = carry
      args = jax.tree.leaves((h, read(stacked, i), invariants, first_layer + i))
      h, stored = jax.tree.unflatten(out_tree, replay(*args))
      return h, _write(stacks, stored, i)

    stacks = [_empty((length, *a.shape), a.dtype, spec) for a, spec in zip(avals, specs)]
    h, stacks = jax.lax.fori_loop(0, length, step, (h, stacks))
    return h, (stacks, stacked, invariants)

  def backward(residuals, g):
    stacks, stacked, invariants = residuals
    params = params_tree.flatten_up_to(stacked)
    trained = [_differentiable(x) for x in params]

    def step(k, carry):
      g, grads = carry
      i = length - 1 - k
      origin = {"stored": _slice(stacks, i), "param": read_leaves(params, i),
                "invariant": jax.tree.leaves(invariants), "layer": [first_layer + i]}
      leaves = [s.index if s.kind == "static" else origin[s.kind][s.index] for s in plan["sources"]]
      g, d_params = jax.tree.unflatten(plan["treedef"], leaves)(g)
      return g, _write(grads, [d for d, t in zip(jax.tree.leaves(d_params), trained) if t], i)

    grads = [_empty(x.shape, d or x.dtype, _spec(x)) for x, d, t in zip(params, dtypes, trained) if t]
    g, grads = jax.lax.fori_loop(0, length, step, (g, grads))
    grads = iter(grads)
    d_stacked = [next(grads).astype(x.dtype) if t else _no_gradient(x) for x, t in zip(params, trained)]
    return g, jax.tree.unflatten(params_tree, d_stacked), jax.tree.map(_no_gradient, invariants)

  run.defvjp(forward, backward)
  if platform.splits_explicit_axes():  # the loop's stacks and gradients would need every sharding spelt out
    return jax.sharding.auto_axes(run, out_sharding=_spec(h))(h, stacked, invariants)
  return run(h, stacked, invariants)
