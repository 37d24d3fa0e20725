"""Capturing the GEMM inputs of a model's linears for `fp4jax.diagnostics.operand_report`.

`capture_linears(model, tokens, key)` runs a Llama once (jitted) and returns, per FP4Linear, its input x, its
kernel w and the gradient dy of the mean next-token cross-entropy w.r.t. its output. It changes nothing in the
layers or in `model`: inside the traced function a copy of the model is merged from its state, and each chosen
FP4Linear of the copy gets a subclass (its class swapped back afterwards) whose `__call__` runs the layer
unchanged, hands out its input and adds a zero "probe" to its output; the gradient of the loss w.r.t. the
probe is dy. Linears that the model runs as one product (`LlamaConfig.fuse_linears`) run one by one in the
copy, each with its own key.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax.diagnostics import GemmInputs
from fp4jax.nn.linear import FP4Linear
from fp4jax.nn.llama.model import Llama


def linear_paths(model: nnx.Module) -> dict[str, FP4Linear]:
  """{dotted module path (e.g. "layers.0.attn.q"): module} of every FP4Linear in `model`."""
  return {".".join(map(str, path)): m for path, m in nnx.iter_graph(model) if isinstance(m, FP4Linear)}


@contextlib.contextmanager
def _probed(modules: dict[str, FP4Linear], probes: dict[str, jax.Array] | None,
            inputs: dict[str, jax.Array]) -> Iterator[None]:
  """Within the block, each module of `modules` records its input into `inputs` and adds `probes[name]`
  (when given) to its output; the original classes come back on exit."""
  originals = {}
  try:
    for name, module in modules.items():
      cls = type(module)

      def call(self, x, *, key=None, _name=name, _cls=cls):
        inputs[_name] = x
        y = _cls.__call__(self, x, key=key)
        return y if probes is None else y + probes[_name].astype(y.dtype)

      originals[name] = cls
      object.__setattr__(module, "__class__", type(f"Probed{cls.__name__}", (cls,), {"__call__": call}))
    yield
  finally:
    for name, cls in originals.items():
      object.__setattr__(modules[name], "__class__", cls)


def _loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of logits [B, T, V] against targets [B, T]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _check_tokens(tokens: jax.Array, vocab_size: int) -> None:
  """A ValueError unless `tokens` is an integer array [B, T + 1] with B, T >= 1 and, when its values are known
  (not traced), ids in [0, vocab_size): an id out of range makes the loss, hence every dy, NaN."""
  if not hasattr(tokens, "dtype") or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
    raise ValueError(f"capture_linears' tokens takes an integer array [B, T + 1] of token ids, got "
                     f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')}{list(getattr(tokens, 'shape', ()))}")
  if tokens.shape[0] < 1 or tokens.shape[1] < 2:
    raise ValueError(f"capture_linears' tokens [B, T + 1] needs B >= 1 and T >= 1 (inputs and next-token "
                     f"targets), got shape {tuple(tokens.shape)}")
  if not isinstance(tokens, jax.core.Tracer):
    low, high = int(jnp.min(tokens)), int(jnp.max(tokens))
    if low < 0 or high >= vocab_size:
      raise ValueError(f"capture_linears' tokens hold ids in [{low}, {high}], outside [0, {vocab_size=})")


def capture_linears(model: Llama, tokens: jax.Array, key: jax.Array | None = None,
                    names: Sequence[str] | None = None) -> dict[str, GemmInputs]:
  """x [M, K], w [K, N] and dy [M, N] (float32) of the chosen linears of `model` on `tokens`.

  Args:
    model: an `fp4jax.nn.llama.Llama` with `scan_layers=False` (a scanned model runs its stacked blocks inside
      a loop, out of reach of the probes; `fp4jax.nn.llama.model.copy_params` gives an unrolled copy).
    tokens: [B, T + 1] int token ids: the model reads tokens[:, :-1] and the loss is the mean cross-entropy of
      its logits against tokens[:, 1:].
    key: the model's step key (keyed routes).
    names: module paths of FP4Linear layers (`linear_paths`); None: all of them.
  Returns:
    {path: GemmInputs(x, w, dy)}: x the layer's input flattened to [B * T, K] as the layer received it, w its
    kernel in the layer's compute dtype (what fp4_dot multiplies), dy the loss gradient w.r.t. its output
    (before any bias), flattened to [B * T, N]; all cast to float32.
  """
  if getattr(model, "scan_layers", False):
    raise ValueError("capture_linears needs a model built with scan_layers=False")
  _check_tokens(tokens, model.config.vocab_size)
  if isinstance(names, str):
    raise TypeError(f"capture_linears' names takes a list of module paths, got the string {names!r}: "
                    f"use [{names!r}]")
  available = linear_paths(model)
  names = list(available) if names is None else list(names)
  missing = [n for n in names if n not in available]
  if missing:
    raise ValueError(f"no FP4Linear at {missing}; the model's linears are {sorted(available)}")
  graphdef, state = nnx.split(model)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def run(state, probes):
    """The loss and the recorded inputs of a copy of the model (merged from its state), probed."""
    copy = nnx.merge(graphdef, state)
    for _, module in nnx.iter_graph(copy):  # one product per linear, so that each layer's call is probed
      if getattr(module, "fused", False):
        module.fused = False
    paths = linear_paths(copy)
    with _probed({n: paths[n] for n in names}, probes, recorded := {}):
      logits = copy(inputs, key=key)
    return _loss(logits, targets), recorded

  def zeros(state):
    _, recorded = run(state, None)
    return {n: jnp.zeros((*recorded[n].shape[:-1], available[n].out_features), jnp.float32) for n in names}

  probes = {n: jnp.zeros(s.shape, s.dtype) for n, s in jax.eval_shape(zeros, state).items()}
  dys, xs = jax.jit(jax.grad(lambda p, s: run(s, p), has_aux=True))(probes, state)
  out = {}
  for n in names:
    module = available[n]
    x = xs[n].astype(jnp.float32)
    w = module.kernel[...].astype(module.dtype).astype(jnp.float32)
    out[n] = GemmInputs(x.reshape(-1, x.shape[-1]), w, dys[n].reshape(-1, module.out_features))
  return out
