"""The training loop: mesh, sharded model + AdamW state, one jitted train step, eval, checkpoints, metrics.

Jit style: functional NNX. `nnx.split((model, optimizer))` gives a static graphdef and one `nnx.State`
pytree; `train_step(state, batch, step)` merges them inside `jax.jit`, takes the gradient with
`nnx.value_and_grad` (in `data.microbatches` sequential passes: `loss_and_grads`), applies `optimizer.update`
and returns the new state; the eval step runs its batch in the same passes (`eval_loss`). The input state is
donated (`donate_argnums=0`), so parameters and Adam moments are updated in place. The state is created directly
with its shardings (`jax.jit(init, out_shardings=...)`), from the `nnx.with_partitioning` metadata the
model puts on its params (mesh axes ("data", "fsdp")); batches are sharded over both axes.

Randomness: the step key is `fold_in(key(seed), step)`, so a resumed run replays exactly the keys of an
uninterrupted one; the data position is checkpointed with the state.

Non-finite guard without a per-step host sync: step t's loss is read after step t+1 is dispatched, so the
device never waits on the host; before an eval or a checkpoint the latest loss is read synchronously and the
whole state checked finite (a finite loss says nothing of the update that followed it), so a NaN/inf state is
never saved and the run stops naming the step. Steps are 1-based everywhere (messages, metrics, checkpoints,
the table): step N is the N-th optimizer update, and checkpoint N holds the state after it.
A stop signal (SIGINT, SIGTERM) checkpoints the step in flight and ends the run (`train.interrupt`).

Multi-host (documented, untested here): launch one process per host with the usual JAX env
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a SLURM/TPU environment) and set
FP4JAX_DISTRIBUTED=1; `main` then calls `jax.distributed.initialize()` before touching devices. Every host
builds the same global batch from the same token cache; `jax.make_array_from_callback` keeps only its shards.
Only process 0 writes logs, plots and tables; Orbax coordinates the checkpoint writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import sys
import threading
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train import checkpoint, config as config_lib, data, interrupt, lock, metrics, tokenizers
from train.errors import UserError, check_writable_dir

MESH_AXES = ("data", "fsdp")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
assert set(DTYPES) == set(config_lib.DTYPES)


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN/inf loss or state; the run stopped without checkpointing the bad state."""


def make_mesh(shape: tuple[int, ...], devices: list[Any] | None = None) -> Mesh:
  """A ("data", "fsdp") mesh over `devices` (default all); one entry of `shape` may be -1 (the rest)."""
  devices = jax.devices() if devices is None else devices
  if len(shape) != 2:
    raise UserError(f"run.mesh={list(shape)} must have two entries (data, fsdp)")
  n = len(devices)
  known = math.prod(s for s in shape if s != -1)
  dims = tuple(n // known if s == -1 else s for s in shape)
  if math.prod(dims) != n:
    raise UserError(f"run.mesh={list(shape)} does not cover the {n} device(s) (resolved to {list(dims)}); use sizes "
                    f"whose product is {n}, e.g. [-1, 1]")
  return Mesh(np.asarray(devices).reshape(dims), MESH_AXES)


def llama_config(cfg: config_lib.Config, vocab_size: int):
  """The LlamaConfig: preset + overrides, vocab padded to a multiple of 128, max_seq_len >= seq_len."""
  from fp4jax.nn.llama import LlamaConfig
  overrides = dict(cfg.model.overrides)
  overrides.setdefault("vocab_size", -(-vocab_size // 128) * 128)
  preset = LlamaConfig.preset(cfg.model.preset, **overrides)
  if preset.max_seq_len < cfg.data.seq_len:
    preset = dataclasses.replace(preset, max_seq_len=cfg.data.seq_len)
  if preset.vocab_size < vocab_size:
    raise UserError(f"model.overrides.vocab_size={preset.vocab_size} < the tokenizer's vocab_size={vocab_size}; "
                    f"drop the override (the tokenizer's size, padded, is the default) or raise it")
  return preset


def route_configs(cfg: config_lib.Config) -> list[tuple[str, config_lib.Config]]:
  """(route, its run's config) for each route: compare mode (run.routes set) puts each in out_dir/<route>/."""
  if not cfg.run.routes:
    return [(cfg.route, cfg)]
  return [(name, config_lib.replace(cfg, route=name, run={"out_dir": os.path.join(cfg.run.out_dir, name)}))
          for name in cfg.run.routes]


def check_mesh(cfg: config_lib.Config) -> Mesh:
  """The run's mesh; fails if it does not fit the devices or the batch does not split over it."""
  mesh = make_mesh(cfg.run.mesh)
  per_pass = cfg.data.batch_size // cfg.data.microbatches
  if per_pass % mesh.size:
    split = (f"data.batch_size={cfg.data.batch_size}" if cfg.data.microbatches == 1 else
             f"data.batch_size / data.microbatches = {cfg.data.batch_size} / {cfg.data.microbatches} = {per_pass}")
    raise UserError(f"{split} must be a multiple of the {mesh.size} devices of run.mesh={list(cfg.run.mesh)}")
  return mesh


def check_param_sharding(cfg: config_lib.Config, lcfg, mesh: Mesh) -> None:
  """Fails with a UserError if a parameter dimension that the model shards over a mesh axis does not split evenly.

  Otherwise the initializer raises jax's IndivisibleError, after the data is tokenized. The shapes and partition
  specs come from `nnx.eval_shape` of the model `init_train_state` builds (no memory, milliseconds); the Adam
  moments share them, so the parameters suffice. The message suggests a run.mesh of the same devices that fits.
  """
  state = nnx.state(nnx.eval_shape(lambda: build_model(cfg, lcfg)), nnx.Param)
  specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
  sharded = []  # (parameter path, dimension index, size, mesh axes)
  for path, var in nnx.to_flat_state(state):
    for i, (size, axes) in enumerate(zip(var.get_value().shape, specs[path].get_value())):
      if axes is not None:
        sharded.append((".".join(map(str, path)), i, size, (axes,) if isinstance(axes, str) else tuple(axes)))

  def first_misfit(shape: dict[str, int]):
    return next((s for s in sharded if s[2] % math.prod(shape[a] for a in s[3])), None)

  misfit = first_misfit(dict(mesh.shape))
  if misfit is None:
    return
  name, dim, size, axes = misfit
  n, split = mesh.size, math.prod(mesh.shape[a] for a in axes)
  fits = [[d, n // d] for d in range(1, n + 1) if n % d == 0 and first_misfit(dict(zip(MESH_AXES, (d, n // d))))
          is None]
  axis = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {list(axes)}"
  raise UserError(f"model parameter {name}: dimension {dim} (size {size}) is sharded over {axis} of size {split} "
                  f"(run.mesh={list(cfg.run.mesh)}), which does not divide it; use "
                  + (f"run.mesh={fits[0]}, or " if fits else "")
                  + f"model.overrides whose sharded sizes are multiples of {split}")


def preflight(cfg: config_lib.Config) -> tokenizers.Tokenizer:
  """Every check of `cfg` that needs no tokens, so that a mistake shows before any tokenizing or compiling:
  the tokenizer loads, the model and route rules build, the mesh fits the devices, the batch and every sharded
  parameter dimension, and every data source names files, none both a train and a held-out one.
  (`run_all` then checks what each route's out_dir holds, once it has locked it.)"""
  tok = tokenizers.get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
  lcfg = llama_config(cfg, tok.vocab_size)
  used = set()  # the routes of every run's rules, each traced once
  for _, sub in route_configs(cfg):
    rules = route_rules(sub, lcfg.n_layers)
    used |= {rules.default, *(route for _, route in rules.rules + rules.fallback)}
  check_kernels(cfg, used)
  mesh = check_mesh(cfg)
  for _, sub in route_configs(cfg):  # a route may change the parameters' layout (scan_layers: auto)
    check_param_sharding(sub, lcfg, mesh)
  data.resolve_data(cfg.data)
  for what, path in (("run.out_dir", cfg.run.out_dir), ("data.cache_dir", cfg.data.cache_dir)):
    check_writable_dir(path, what)
  for name, sub in route_configs(cfg) if cfg.run.routes else ():  # compare mode's out_dir/<route>
    check_writable_dir(sub.run.out_dir, f"run.out_dir of route {name}")
  for _, sub in route_configs(cfg):  # Orbax would fail at the first save, after the steps before it
    ckpt = os.path.join(sub.run.out_dir, "ckpt")
    if os.path.lexists(ckpt) and not os.path.isdir(ckpt):
      raise UserError(f"{ckpt!r} is not a directory, where the run keeps its checkpoints: move it away or choose "
                      f"another run.out_dir")
  return tok


def check_kernels(cfg: config_lib.Config, routes) -> None:
  """Fails with a UserError if `kernels` asks for what this JAX backend cannot run, which fp4_dot would otherwise
  find only when compiling: the Pallas kernels compiled for a GPU on another backend (`Impl.resolved`), or a GEMM
  backend that cannot multiply the operands of one of `routes` (names or Routes: those the run's rules use; e.g.
  `native` and the fp8 route), found by tracing one small fp4_dot forward and backward per route."""
  from fp4jax import fp4_dot
  from fp4jax.dot import padding_multiples
  impl = cfg.kernels.impl()
  try:
    impl.resolved()
    for route in sorted(routes, key=str):
      m, k, n = (max(d, 128) for d in padding_multiples(route))
      loss = lambda x, w: fp4_dot(x, w, route=route, key=jax.random.key(0), impl=impl).astype(jnp.float32).sum()
      jax.eval_shape(jax.grad(loss, argnums=(0, 1)), jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                     jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
  except ValueError as err:
    raise UserError(f"kernels: {err}") from err


def route_rules(cfg: config_lib.Config, n_layers: int):
  """`rules.extra` ("regex=route", tried first; the model rejects one that decides no layer), then the
  standard recipe for `cfg.route` (its fallback rules, which may decide none)."""
  from fp4jax.nn import RouteRules
  std = RouteRules.standard(cfg.route, n_layers=n_layers, bf16_first=cfg.rules.bf16_first,
                            bf16_last=cfg.rules.bf16_last)
  return dataclasses.replace(std, rules=RouteRules.parse(list(cfg.rules.extra)).rules)


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


@dataclasses.dataclass
class TrainState:
  """The jitted functions and live state of one run (what `init_train_state` builds)."""
  graphdef: Any
  state: nnx.State
  mesh: Mesh
  batch_sharding: NamedSharding
  train_step: Any
  eval_step: Any
  all_finite: Any


class CompiledOnFirstCall:
  """`jitted(*args, *bound)`, compiled on the first call by `fp4jax.compiling.compile_program` (the Pallas kernels
  alone and in parallel first, on `threads`, kept in `directory`; threads=0 compiles as jax.jit does), then
  run as that compiled program. Later calls must pass arguments of the first call's shapes and shardings, as a
  training loop does. It is traced under `mesh` (`jax.set_mesh`), so that fp4_dot's quantizers run on each
  device's own tokens (`fp4jax.Impl.token_axes`)."""

  def __init__(self, jitted, *bound, threads: int | None, directory, mesh: Mesh):
    self.jitted, self.bound, self.threads, self.directory, self.mesh = jitted, bound, threads, directory, mesh
    self.compiled = self.report = None

  def __call__(self, *args):
    if self.compiled is None:
      from fp4jax import compiling

      def compile_():
        with jax.set_mesh(self.mesh):
          return compiling.compile_program(self.jitted, *args, *self.bound, threads=self.threads,
                                           directory=self.directory)
      self.compiled, self.report = on_worker_thread(compile_)
    return self.compiled(*args, *self.bound)


def on_worker_thread(fn: Callable[[], Any], poll: float = 0.2) -> Any:
  """fn() run on another thread while this one waits in short joins, so that a signal is handled at once:
  Python runs signal handlers on the main thread only, between bytecodes, and a minutes-long XLA compile on
  it held a Ctrl-C (and the second one, meant to stop at once) until the compile ended. fn's exception is
  raised here; a KeyboardInterrupt or a handler's exception leaves the worker behind (a daemon thread)."""
  result: dict[str, Any] = {}

  def run():
    try:
      result["value"] = fn()
    except BaseException as err:  # re-raised on the calling thread
      result["error"] = err

  worker = threading.Thread(target=run, name="fp4jax-compile", daemon=True)
  worker.start()
  while worker.is_alive():
    worker.join(poll)
  if "error" in result:
    raise result["error"]
  return result["value"]


def build_model(cfg: config_lib.Config, lcfg):
  """The run's Llama (route rules, kernels, dtype, scanning) with parameters from run.seed: one definition for
  the train state and the sharding preflight."""
  from fp4jax.nn.llama import Llama
  from fp4jax.nn.llama.model import SCAN_POLICIES
  from fp4jax.nn.rules import UnusedRulesError
  try:
    return Llama(lcfg, rules=route_rules(cfg, lcfg.n_layers), rngs=nnx.Rngs(cfg.run.seed),
                 impl=cfg.kernels.impl(), dtype=DTYPES[cfg.model.dtype], scan_layers=cfg.model.scan_layers,
                 scan_policy=SCAN_POLICIES[cfg.model.scan_saves])
  except UnusedRulesError as e:  # a misspelt rules.extra: one line before any work (preflight builds the model)
    raise config_lib.ConfigError(f"rules.extra: {e}") from e


def init_train_state(cfg: config_lib.Config, vocab_size: int, mesh: Mesh) -> TrainState:
  from fp4jax import platform
  lcfg = llama_config(cfg, vocab_size)
  tx = make_tx(cfg.optim, cfg.run.steps)

  def create():
    model = build_model(cfg, lcfg)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  shardings = nnx.get_named_sharding(abstract, mesh)
  with jax.set_mesh(mesh):
    state = platform.compile_initializer(lambda: nnx.split(create())[1], out_shardings=shardings)()
  # The keys are arguments of the jitted steps, not constants inside them: a constant key would make the
  # program, and so its persistent-cache entry, differ per run.seed (a study's second seed compiled afresh).
  base_key = jax.random.key(cfg.run.seed)
  eval_key = jax.random.fold_in(jax.random.key(cfg.run.seed + 1), 0)

  @functools.partial(jax.jit, donate_argnums=0, out_shardings=(shardings, None, None))
  def keyed_train_step(state, batch, step, base_key):
    model, optimizer = nnx.merge(graphdef, state)
    key = jax.random.fold_in(base_key, step)
    loss, grads = loss_and_grads(model, batch, key, cfg.data.microbatches)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, optax.tree.norm(grads)

  @jax.jit
  def keyed_eval_step(state, batch, eval_key):
    model, _ = nnx.merge(graphdef, state)
    return eval_loss(model, batch, eval_key, cfg.data.microbatches)

  threads = None if cfg.run.kernels_first else 0
  kernels = platform.kernel_cache_dir(platform.cache_dir(cfg.run.compile_cache))
  # (state, batch, step) and (state, batch)
  train_step = CompiledOnFirstCall(keyed_train_step, base_key, threads=threads, directory=kernels, mesh=mesh)
  eval_step = CompiledOnFirstCall(keyed_eval_step, eval_key, threads=threads, directory=kernels, mesh=mesh)

  @jax.jit
  def all_finite(state):
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))

  batch_sharding = NamedSharding(mesh, P(MESH_AXES, None))
  return TrainState(graphdef, state, mesh, batch_sharding, train_step, eval_step, all_finite)


def checkpoint_alternative(ts: TrainState) -> checkpoint.Alternative | None:
  """For a model whose blocks are scanned: the per-layer layout of its state (`layers.{i}`), which scanned runs
  saved before their blocks' parameters were held stacked (3da1e21), and the conversion from it, so that those
  checkpoints resume (`Checkpointer.restore`). None for an unrolled model, whose layout did not change."""
  from fp4jax.nn.llama.model import stacked_params, unstacked_params
  model, _ = nnx.merge(ts.graphdef, ts.state)
  if not model.scan_layers:
    return None
  groups = model.block_groups
  target = checkpoint.abstract_state(ts.state)

  def take(s: jax.ShapeDtypeStruct, _) -> jax.ShapeDtypeStruct:  # one layer of a stacked leaf, its sharding
    sharding = s.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=sharding)

  shardings = jax.tree.map(lambda s: s.sharding, target)
  return checkpoint.Alternative(unstacked_params(target, groups, take),
                                lambda restored: jax.device_put(stacked_params(restored, groups), shardings))


def to_global(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """The global batch as a sharded array; each process materializes only its addressable shards."""
  return jax.make_array_from_callback(batch.shape, sharding, lambda idx: batch[idx])


def step_memory(compiled, devices, *more) -> tuple[int | None, str]:
  """(bytes, kind) of a route's memory for its table row: XLA's plan of its compiled train step
  (`metrics.planned_bytes`), or the largest plan of it and the `more` compiled steps (the eval step, which runs
  on the same devices between train steps), the route's own whatever ran before it in the process; else (no
  train step compiled in this call: a resumed finished run) the process's peak so far, the max device
  peak_bytes_in_use where the backend reports it, else the max RSS, which holds every earlier route of the
  process too (JAX resets neither: it made a compare run's later routes look as large as the largest before
  them)."""
  planned = None if compiled is None else metrics.planned_bytes(compiled)
  if planned is not None:
    plans = [metrics.planned_bytes(c) for c in more if c is not None]
    return max([planned] + [p for p in plans if p is not None]), "step plan"
  peaks = [s.get("peak_bytes_in_use") for d in devices if (s := d.memory_stats())]
  peaks = [p for p in peaks if p is not None]
  if peaks:
    return max(peaks), "process peak"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


def evaluate(ts: TrainState, batches: list[np.ndarray]) -> float:
  losses = [ts.eval_step(ts.state, to_global(b, ts.batch_sharding)) for b in batches]
  return float(np.mean([float(l) for l in losses]))


class _StepRecorder:
  """Checks and records each step's loss once it is read to the host, one step behind the dispatch.

  `record` blocks on the loss array, so the loop calls it for step t only after step t+1 is dispatched (and
  synchronously before an eval or a checkpoint). Throughput counts the wall time from the end of the
  first (compiling) step of this process to the end of the latest one, less the eval/checkpoint pauses.
  The last `TAIL` losses, the open log window and the timed steps and seconds so far go into each checkpoint
  (`saved`, `resume`), so a resumed run reports and logs the numbers an uninterrupted one would, and its
  throughput covers every process's timed steps (also when it resumes at the final step and runs none).
  """

  TAIL = 10  # the table's train loss: the mean of the last TAIL step losses

  def __init__(self, cfg: config_lib.Config, label: str, ckpt: checkpoint.Checkpointer,
               log: metrics.MetricsLogger | None, bar: metrics.ProgressBar):
    self.cfg, self.label, self.ckpt, self.log, self.bar = cfg, label, ckpt, log, bar
    self.schedule = lr_schedule(cfg.optim, cfg.run.steps)
    self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    self.losses: dict[int, float] = {}  # the steps this process ran
    self.tail: list[float] = []  # the last TAIL step losses, restored ones included
    self.rate = 0.0
    self._window: list[float] = []
    self._t_first: float | None = None
    self.t_start = time.time()  # before the first step's dispatch (which compiles the step)
    self.first_step_s: float | None = None
    self.compile_s: float | None = None  # the first call of the train step (this process's, else a checkpoint's)
    self._n_timed, self._pause_s, self._timed_s = 0, 0.0, 0.0
    self._before_n, self._before_s = 0, 0.0  # timed steps and seconds of earlier processes (`resume`)

  @contextlib.contextmanager
  def paused(self):
    """Time spent inside (eval, checkpoint, logging) is left out of the throughput."""
    t0 = time.time()
    try:
      yield
    finally:
      self._pause_s += time.time() - t0

  def record(self, step: int, loss: jax.Array, gnorm: jax.Array) -> None:
    """Checks and logs the loss of `step` (1-based: the step-th optimizer update, as checkpoints count)."""
    value, grad_norm = float(loss), float(gnorm)  # blocks until the step has run
    for what, v in (("loss", value), ("gradient norm", grad_norm)):  # a NaN gradient leaves its update NaN
      if not math.isfinite(v):
        raise NonFiniteLossError(f"[{self.label}] {what} is {v} at step {step}; stopped. {last_good(self.ckpt)}")
    now = time.time()
    if self._t_first is None:
      self._t_first, self._pause_s = now, 0.0
      self.first_step_s = now - self.t_start
    else:
      self._n_timed += 1
      self._timed_s = now - self._t_first - self._pause_s
      self.rate = self._rate()
    self.losses[step] = value
    self.tail = (self.tail + [value])[-self.TAIL:]
    self._window.append(value)
    total = self.cfg.run.steps
    eta = (total - step) * self.tokens_per_step / self.rate if self.rate else None
    self.bar.update(step, value, self.rate, eta)
    if self.log and (step % self.cfg.run.log_every == 0 or step == total):
      with self.paused():  # host work, not training: the process's first log took 0.78 s on an H100 (the
        # schedule's eager jnp ops compiling, the writers' first write), 20x a Llama-30M step, in the first
        # route's throughput only
        self.log.log(step, "train", {"loss": float(np.mean(self._window)), "grad_norm": grad_norm,
                                     "tokens_per_s": self.rate, "lr": float(self.schedule(step - 1))})
      self._window = []

  def _rate(self) -> float:
    seconds = self._before_s + self._timed_s
    return (self._before_n + self._n_timed) * self.tokens_per_step / seconds if seconds > 0 else 0.0

  def saved(self) -> dict[str, Any]:
    """What a checkpoint keeps of the losses and the timing (JSON, beside the data position)."""
    return {"loss_tail": self.tail, "loss_window": self._window,
            "timed_steps": self._before_n + self._n_timed, "timed_s": self._before_s + self._timed_s,
            "compile_s": self.compile_s, "first_step_s": self.first_step_s}

  def resume(self, saved: dict[str, Any]) -> None:
    """Takes `saved`'s losses and timing back (checkpoints of older versions have none: the first window then
    starts empty, and the throughput counts this process's steps only)."""
    self.tail = [float(v) for v in saved.get("loss_tail", [])]
    self._window = [float(v) for v in saved.get("loss_window", [])]
    self._before_n, self._before_s = int(saved.get("timed_steps", 0)), float(saved.get("timed_s", 0.0))
    self.rate = self._rate()
    self.compile_s, self.first_step_s = saved.get("compile_s"), saved.get("first_step_s")  # until this process's


@contextlib.contextmanager
def compile_ticker(label: str, *, enabled: bool = True, every: float = 10.0):
  """While inside (the first call of the train step: tracing and XLA compilation), prints a plain line every
  `every` seconds so a long compile is not silence; yields a function returning the seconds spent inside."""
  t0 = time.time()
  stop = threading.Event()

  def tick():
    while not stop.wait(every):
      print(f"[{label}] compiling the train step: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

  thread = threading.Thread(target=tick, daemon=True)
  if enabled:
    thread.start()
  elapsed, ended = [None], "train step compiled in"
  try:
    yield lambda: elapsed[0]
  except BaseException:
    ended = "train step's first call failed after"  # not reported as compiled
    raise
  finally:
    elapsed[0] = time.time() - t0
    stop.set()
    if enabled:
      thread.join()
      print(f"[{label}] {ended} {elapsed[0]:.1f} s", file=sys.stderr, flush=True)


def last_good(ckpt: checkpoint.Checkpointer) -> str:
  """The divergence message's tail: the newest checkpoint to go back to, if any."""
  step = ckpt.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {ckpt.directory}."
  return f"Last good checkpoint: step {step} in {ckpt.directory}"


def run(cfg: config_lib.Config, train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int,
        *, label: str | None = None) -> dict[str, Any]:
  """Trains (or resumes) one route; returns the table row plus per-step losses {step: loss}, steps 1-based."""
  r = cfg.run
  label = label or cfg.route
  lead = jax.process_index() == 0
  saved = check_out_dir(cfg)
  if saved is not None:
    if lead:
      print(f"[{label}] finished earlier: reporting {os.path.join(r.out_dir, RESULT_FILE)} (use another run.out_dir "
            f"to train again)", file=sys.stderr)
    return {**saved, "losses": {}}
  os.makedirs(r.out_dir, exist_ok=True)
  if lead and not checkpoint.saved_steps(os.path.join(r.out_dir, "ckpt")):  # a fresh start: no log to continue
    metrics.set_aside(r.out_dir, log=sys.stderr)
  if lead:  # written whole or not at all (a process stopped mid-write left a torn file that blocked resuming)
    path = os.path.join(r.out_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
      yaml.safe_dump(config_lib.to_dict(cfg), f, sort_keys=False)
    os.replace(path + ".tmp", path)
  mesh = check_mesh(cfg)
  it = data.WindowIterator(train_tokens, cfg.data.seq_len, cfg.data.batch_size, r.seed)  # checks sizes first
  eval_batches = data.eval_windows(eval_tokens, cfg.data.seq_len, cfg.data.batch_size, r.eval_batches)
  ts = init_train_state(cfg, vocab_size, mesh)
  ckpt = checkpoint.Checkpointer(os.path.join(r.out_dir, "ckpt"))
  start, data_state = 0, {}
  if ckpt.latest_step() is not None:
    ts.state, data_state, start = ckpt.restore(ts.state, alternative=checkpoint_alternative(ts))
    it.restore(data_state)
  log = metrics.MetricsLogger(r.out_dir, label, after=start) if lead else None
  bar = metrics.ProgressBar(r.steps, label, enabled=r.progress and lead, every=r.log_every)
  rec = _StepRecorder(cfg, label, ckpt, log, bar)
  rec.resume(data_state)
  eval_loss = None
  pending = None  # (step, loss, grad norm) of the last dispatched step, its loss not yet checked
  stop = interrupt.StopRequest(label, enabled=jax.process_count() == 1)
  try:
    with stop:
      for done in range(start + 1, r.steps + 1):  # `done`: 1-based, the updates made once this step has run
        batch = to_global(next(it), ts.batch_sharding)
        if done == start + 1:  # the first call traces and compiles the step: say so while it lasts, and time it
          with compile_ticker(label, enabled=lead) as timer:
            ts.state, loss, gnorm = ts.train_step(ts.state, batch, jnp.int32(done - 1))
          rec.compile_s = timer()
          report = getattr(ts.train_step, "report", None)
          if lead and report is not None and report.summary():
            print(f"[{label}] {report.summary()}", file=sys.stderr, flush=True)
        else:
          ts.state, loss, gnorm = ts.train_step(ts.state, batch, jnp.int32(done - 1))
        if pending:  # the previous step's loss, read while this step runs: no device idle time
          rec.record(*pending)
        pending = (done, loss, gnorm)
        if (r.eval_every and done % r.eval_every == 0) or done == r.steps:
          rec.record(*pending)
          pending = None
          with rec.paused():
            eval_loss = evaluate(ts, eval_batches)
          if log:
            log.log(done, "eval", {"loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0))})
        # A stop request (SIGINT, SIGTERM) saves the state after this step, also when it came during the eval.
        if (r.ckpt_every and done % r.ckpt_every == 0) or done == r.steps or stop.signum is not None:
          if pending:
            rec.record(*pending)
            pending = None
          with rec.paused():
            if not bool(ts.all_finite(ts.state)):  # a finite loss does not prove the update after it finite
              raise NonFiniteLossError(
                  f"[{label}] state is non-finite after step {done} (whose loss was finite); stopped before "
                  f"saving it. {last_good(ckpt)}")
            ckpt.save(done, ts.state, {**it.state(), **rec.saved()})
          if stop.signum is not None:
            raise interrupt.Interrupted(stop.signum, label, done, ckpt.directory)
  finally:
    bar.close()
    ckpt.close()
    if log:
      log.close()
  if eval_loss is None:  # nothing left to train (resumed a finished run): evaluate the restored state
    eval_loss = evaluate(ts, eval_batches)
  peak, peak_kind = step_memory(getattr(ts.train_step, "compiled", None), mesh.devices.flat,
                                getattr(ts.eval_step, "compiled", None))
  row = {"route": label, "steps": r.steps, "train_loss": float(np.mean(rec.tail)) if rec.tail else None,
         "eval_loss": eval_loss, "eval_batches": len(eval_batches), "tokens_per_s": rec.rate or None,
         "first_step_s": rec.first_step_s, "compile_s": rec.compile_s, "peak_bytes": peak,
         "peak_kind": peak_kind, "status": "ok"}
  if lead:
    curves = {label: metrics.read_jsonl(log.jsonl_path)}
    metrics.plot_losses(curves, os.path.join(r.out_dir, "loss.png"), title=label)
    metrics.write_json(os.path.join(r.out_dir, RESULT_FILE), row)  # a rerun reports this instead of re-deriving it
  return {**row, "losses": rec.losses}


RESULT_FILE = "result.json"


def check_out_dir(cfg: config_lib.Config) -> dict[str, Any] | None:
  """The saved result row when run.out_dir holds this run finished, else None (train, from its checkpoint if any).

  Fails with a UserError, before any work, when the checkpoint there cannot continue this config: run.resume is
  false, a result-relevant setting differs from the run that wrote it, or it is past run.steps. A finished run
  whose checkpoints were deleted since (to free the disk) is finished too: its result is reported, or refused
  on the same terms, not trained over.
  """
  r = cfg.run
  steps = checkpoint.saved_steps(os.path.join(r.out_dir, "ckpt"))
  result = os.path.join(r.out_dir, RESULT_FILE)
  finished = os.path.exists(result)
  if not steps and not finished:
    return None
  held = (f"{r.out_dir} holds a run checkpointed at step {steps[-1]}" if steps else
          f"{r.out_dir} holds a finished run ({RESULT_FILE}, no checkpoint)")
  if not r.resume:
    raise UserError(f"{held} and run.resume=false: use another run.out_dir, or delete it to train afresh")
  saved_cfg = os.path.join(r.out_dir, "config.yaml")  # written before the run's first checkpoint
  try:
    with open(saved_cfg) as f:
      saved = yaml.safe_load(f)
  except (FileNotFoundError, yaml.YAMLError, UnicodeDecodeError) as err:
    saved = err
  if not isinstance(saved, dict) or not saved:  # not comparable: its result would pass for these settings'
    state = "missing" if isinstance(saved, FileNotFoundError) else "damaged or empty"
    raise UserError(f"{held}, but its {saved_cfg} is {state}, so its settings cannot be compared with these: "
                    f"restore it (the settings the run was started with), or use another run.out_dir")
  changed = config_lib.changed_settings(saved, config_lib.to_dict(cfg))
  if changed:
    raise UserError(f"{held} with other settings ({'; '.join(changed[:4])}): use another run.out_dir for the new "
                    f"settings")
  if steps and steps[-1] > r.steps:
    raise UserError(f"{held}, past run.steps={r.steps}: use another run.out_dir for a shorter run")
  saved_steps = (saved.get("run") or {}).get("steps", r.steps)
  if saved_steps != r.steps:  # the learning-rate schedule spans run.steps: resuming would switch schedules
    raise UserError(f"{held} of a run.steps={saved_steps} learning-rate schedule; run.steps={r.steps} would go on "
                    f"along another one: use another run.out_dir for a longer run")
  if finished and (not steps or steps[-1] == r.steps):
    with open(result) as f:
      return json.load(f)
  return None


def run_all(cfg: config_lib.Config, *, log=None) -> list[dict[str, Any]]:
  """One run per route of `run.routes` (compare mode, out_dir/<route>/) or of `route`; shared data.

  Writes out_dir/table.md, out_dir/summary.json and (compare mode) out_dir/loss.png with every curve. A
  route whose loss goes non-finite gets a row with that status (not "ok"); compare mode then goes on to the next
  route, and the caller decides the exit status from the rows. A route already finished in its out_dir with the
  same settings is not trained again: its saved result.json row is reported. The config is checked in full first,
  then out_dir, and in compare mode each route's out_dir/<route> (which a single-route run may name), is locked
  for the whole call (`train.lock.RunLock`). An out_dir that holds a run of the other layout (single-route or
  compare), whose plot and table this call would overwrite, is refused (`metrics.check_layout`).
  """
  log = sys.stderr if log is None else log
  preflight(cfg)
  with contextlib.ExitStack() as held:
    if jax.process_index() == 0:
      for out_dir in dict.fromkeys([cfg.run.out_dir] + [sub.run.out_dir for _, sub in route_configs(cfg)]):
        held.enter_context(lock.RunLock(out_dir, log=log))
    # under the lock: what a running job writes there is not yet final
    metrics.check_layout(cfg.run.out_dir, compare=bool(cfg.run.routes), route=cfg.route)
    for _, sub in route_configs(cfg):
      check_out_dir(sub)
    return _run_routes(cfg, log)


def _run_routes(cfg: config_lib.Config, log) -> list[dict[str, Any]]:
  compare = bool(cfg.run.routes)
  routes = cfg.run.routes or (cfg.route,)
  train_tokens, eval_tokens, tok = data.load_splits(cfg.data, log=log)
  log.write(f"[train] {len(train_tokens):,} train / {len(eval_tokens):,} held-out {tok.name} tokens; "
            f"routes {list(routes)}; {jax.device_count()} {jax.devices()[0].platform} device(s)\n")
  short = data.short_heldout(len(eval_tokens), cfg.data, cfg.run.eval_batches)
  if short:
    log.write(f"[train] warning: {short}\n")
  rows = []
  for name, sub in route_configs(cfg):
    try:
      rows.append(run(sub, train_tokens, eval_tokens, tok.vocab_size, label=name))
    except NonFiniteLossError as e:
      log.write(f"{e}\n")
      if not compare:
        raise
      rows.append({"route": name, "steps": cfg.run.steps, "status": str(e).split(";")[0].split("] ")[-1]})
    except (UserError, interrupt.Interrupted):  # a mistake, or a stop: for the whole call
      raise
    except Exception as e:  # pylint: disable=broad-except  # a bug in one route: the others still run
      if not compare:
        raise
      log.write(f"[{name}] failed:\n{traceback.format_exc()}")
      rows.append({"route": name, "steps": cfg.run.steps, "status": f"raised {type(e).__name__}"})
    if compare:  # each route's row as soon as it is done: a run cut short keeps the finished ones
      log.write(f"[train] done: {metrics.format_table(rows[-1:]).splitlines()[-1]}\n")
  if jax.process_index() == 0:
    table = metrics.format_table(rows)
    with open(os.path.join(cfg.run.out_dir, "table.md"), "w") as f:
      f.write(table + "\n")
    metrics.write_json(os.path.join(cfg.run.out_dir, "summary.json"), [{k: v for k, v in r.items() if k != "losses"}
                                                                 for r in rows])
    if compare:
      curves = {name: metrics.read_jsonl(p) for name in routes
                if os.path.exists(p := os.path.join(cfg.run.out_dir, name, "metrics.jsonl"))}
      plot = os.path.join(cfg.run.out_dir, "loss.png")
      if not metrics.plot_losses(curves, plot, title="routes compared"):
        log.write("[train] no loss curve to plot: no route logged a step\n")
        if os.path.exists(plot):  # an earlier call's, which would pass for this one's
          os.remove(plot)
  return rows
