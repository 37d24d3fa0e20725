"""What a train step optimizes: the learning-rate schedule, AdamW, the next-token loss, and its value and
gradient over `data.microbatches` sequential passes (the eval step's loss too)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from train import config as config_lib


def lr_schedule(o: config_lib.OptimConfig, steps: int) -> optax.Schedule:
  """Linear warmup, then cosine to min_lr_ratio * lr, or warmup-stable-decay (linear decay at the end)."""
  warmup = min(o.warmup, max(steps - 1, 0))
  end = o.lr * o.min_lr_ratio
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(steps, warmup + 1), end)
  if o.schedule == "wsd":
    decay = max(1, int(round(steps * o.decay_fraction)))
    stable = max(0, steps - warmup - decay)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, o.lr, warmup), optax.constant_schedule(o.lr),
         optax.linear_schedule(o.lr, end, decay)], [warmup, warmup + stable])
  raise ValueError(f"optim.schedule={o.schedule!r}; valid: ['cosine', 'wsd']")


def make_tx(o: config_lib.OptimConfig, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW; weight decay only on matrices (not norm scales, stacked or not)."""
  from fp4jax.nn.llama.model import weight_decay_mask
  return optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      optax.adamw(lr_schedule(o, steps), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=weight_decay_mask))


def cross_entropy(model, batch: jax.Array, key: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of batch [B, T+1] (inputs batch[:, :-1], targets batch[:, 1:])."""
  logits = model(batch[:, :-1], key=key)  # [B, T, V] float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def loss_and_grads(model, batch: jax.Array, key: jax.Array, microbatches: int = 1):
  """(mean cross-entropy, its gradient w.r.t. the model's Params) of batch [B, T+1], in `microbatches`
  sequential passes of B / microbatches sequences each (`data.microbatches`, `microbatch_mean`).

  One pass is `nnx.value_and_grad(cross_entropy)` itself. With more, each pass takes the gradient of its
  microbatch's loss; their losses and float32 gradients are averaged.
  """
  if microbatches == 1:
    return nnx.value_and_grad(cross_entropy)(model, batch, key)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, mb, k):
    return cross_entropy(nnx.merge(graphdef, p, rest), mb, k)

  zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  return microbatch_mean(lambda mb, k: jax.value_and_grad(loss)(params, mb, k), batch, key, microbatches, zero)


def eval_loss(model, batch: jax.Array, key: jax.Array, microbatches: int = 1) -> jax.Array:
  """Mean cross-entropy of batch [B, T+1] in the train step's `microbatches` sequential forward passes
  (`microbatch_mean`), so that an eval batch fits wherever the train step's batch does."""
  if microbatches == 1:
    return cross_entropy(model, batch, key)
  graphdef, state = nnx.split(model)
  return microbatch_mean(lambda mb, k: cross_entropy(nnx.merge(graphdef, state), mb, k), batch, key, microbatches,
                         jnp.zeros((), jnp.float32))


def microbatch_mean(fn: Callable[[jax.Array, jax.Array], Any], batch: jax.Array, key: jax.Array, microbatches: int,
                    zero: Any) -> Any:
  """The mean of fn(microbatch, its key) (a pytree shaped like `zero`) over `microbatches` microbatches of batch
  [B, T+1]: a `lax.scan` runs the passes one after the other, so only one microbatch's activations are alive at
  a time, and sums their outputs, then divides by their count. With a batch mean per microbatch (all of the same
  size) that is the whole batch's mean, up to the order of the float32 sums.
  Microbatch i holds rows i, i + microbatches, i + 2 microbatches, ... of the batch, so each device's rows of
  a batch sharded over the mesh are its rows of every microbatch (no data moves), and draws its random bits
  (SR, random Hadamard signs) with fold_in(key, i).
  """
  b = batch.shape[0]
  passes = batch.reshape(b // microbatches, microbatches, -1).swapaxes(0, 1)  # [microbatches, B/m, T+1]

  def one_pass(total, xs):
    mb, i = xs
    return jax.tree.map(jnp.add, total, fn(mb, jax.random.fold_in(key, i))), None

  total, _ = jax.lax.scan(one_pass, zero, (passes, jnp.arange(microbatches, dtype=jnp.int32)))
  return jax.tree.map(lambda t: t / microbatches, total)
