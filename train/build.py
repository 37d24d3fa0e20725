"""What a run is built from (its mesh, Llama config, route rules and model) and the checks made of a config
before any tokenizing or compiling (`preflight`)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from train import config as config_lib, data, tokenizers
from train.errors import UserError, check_writable_dir

MESH_AXES = ("data", "fsdp")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
assert set(DTYPES) == set(config_lib.DTYPES)


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


def preflight(cfg: config_lib.Config, log: TextIO = sys.stderr
              ) -> tuple[tuple[list[str], list[str]], tokenizers.Tokenizer]:
  """Every check of `cfg` that needs no tokens, so that a mistake shows before any tokenizing or compiling:
  the tokenizer loads, the model and route rules build, the mesh fits the devices, the batch and every sharded
  parameter dimension, and every data source names text files, none both a train and a held-out one. Returns
  those files (`data.resolve_data`) and the tokenizer, for `data.load_splits`.
  (`run_all` then checks what each route's out_dir holds, once it has locked it.) A data.tokenizer_path that the
  byte tokenizer does not read is a warning on `log`, not a mistake: `--set data.tokenizer=byte` over a config
  that names a GPT-2 tokenizer's files still runs."""
  tok = tokenizers.get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
  if cfg.data.tokenizer == "byte" and cfg.data.tokenizer_path:
    log.write(f"[train] warning: data.tokenizer_path={cfg.data.tokenizer_path!r} is ignored: data.tokenizer=byte "
              f"reads no files\n")
  lcfg = llama_config(cfg, tok.vocab_size)
  used = set()  # the routes of every run's rules, each traced once
  for _, sub in route_configs(cfg):
    rules = route_rules(sub, lcfg.n_layers)
    used |= {rules.default, *(route for _, route in rules.rules + rules.fallback)}
  check_kernels(cfg, used)
  check_attention(lcfg, cfg.model.dtype)
  mesh = check_mesh(cfg)
  for _, sub in route_configs(cfg):  # a route may change the parameters' layout (scan_layers: auto)
    check_param_sharding(sub, lcfg, mesh)
  files = data.resolve_data(cfg.data)
  for what, path in (("run.out_dir", cfg.run.out_dir), ("data.cache_dir", cfg.data.cache_dir)):
    check_writable_dir(path, what)
  for name, sub in route_configs(cfg) if cfg.run.routes else ():  # compare mode's out_dir/<route>
    check_writable_dir(sub.run.out_dir, f"run.out_dir of route {name}")
  for _, sub in route_configs(cfg):  # Orbax would fail at the first save, after the steps before it
    ckpt = os.path.join(sub.run.out_dir, "ckpt")
    if os.path.lexists(ckpt) and not os.path.isdir(ckpt):
      raise UserError(f"{ckpt!r} is not a directory, where the run keeps its checkpoints: move it away or choose "
                      f"another run.out_dir")
  return files, tok


def check_kernels(cfg: config_lib.Config, routes) -> None:
  """Fails with a UserError if `kernels` asks for what this JAX backend cannot run (`check_impl`)."""
  check_impl(cfg.kernels.impl(), routes, "kernels")


def check_attention(lcfg, dtype: str) -> None:
  """Fails with a UserError if the model asks for cuDNN's attention off a GPU, in `dtype` (model.dtype) float32,
  or with a head_dim that cuDNN's flash attention does not take (bf16/fp16 only; a multiple of 8 up to
  `cudnn_head_dim_max`, by the rule `attention_impl: auto` goes by: `fp4jax.nn.llama.layers.check_cudnn_head_dim`,
  bench step's check too): its first call would raise after tokenizing (`attention_impl: auto` takes cuDNN's only
  where it runs)."""
  if lcfg.attention_impl != "cudnn":
    return
  if jax.default_backend() != "gpu":
    raise UserError(f"model.overrides.attention_impl='cudnn' needs a GPU (this backend: {jax.default_backend()}); "
                    f"use 'auto' (cuDNN's attention where it runs, else XLA's) or 'xla'")
  if dtype != "bfloat16":
    raise UserError(f"model.overrides.attention_impl='cudnn' takes bfloat16 only (cuDNN's flash attention), not "
                    f"model.dtype={dtype!r}; set model.dtype=bfloat16, or attention_impl 'auto' or 'xla' (XLA's "
                    f"attention in {dtype})")
  from fp4jax.nn.llama.layers import check_cudnn_head_dim
  try:
    check_cudnn_head_dim(lcfg.head_dim, "model.overrides.attention_impl='cudnn'")
  except ValueError as err:
    raise UserError(f"{err} (dim={lcfg.dim} // n_heads={lcfg.n_heads}); change model.overrides dim or n_heads, or "
                    f"set attention_impl 'auto' or 'xla' (XLA's attention)") from err


def check_impl(impl, routes, what: str) -> None:
  """A UserError starting with `what` if `impl` asks for what this JAX backend cannot run, which fp4_dot would
  otherwise find only when compiling: the Pallas kernels compiled for a GPU on another backend (`Impl.resolved`),
  or a GEMM backend that cannot multiply the operands of one of `routes` (names or Routes: those the run's rules
  use; e.g. `native` and the fp8 route, `mosaic` off a GPU), found by tracing one small fp4_dot forward and
  backward per route, 256 wide at least (a size every backend tiles)."""
  from fp4jax import fp4_dot
  from fp4jax.dot import padding_multiples
  try:
    impl.resolved()
    for route in sorted(routes, key=str):
      m, k, n = (max(d, 256) for d in padding_multiples(route))
      loss = lambda x, w: fp4_dot(x, w, route=route, key=jax.random.key(0), impl=impl).astype(jnp.float32).sum()
      jax.eval_shape(jax.grad(loss, argnums=(0, 1)), jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                     jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
  except ValueError as err:
    raise UserError(f"{what}: {err}") from err


def route_rules(cfg: config_lib.Config, n_layers: int):
  """`rules.extra` ("regex=route", tried first; the model rejects one that decides no layer), then the
  standard recipe for `cfg.route` (its fallback rules, which may decide none)."""
  from fp4jax.nn import RouteRules
  std = RouteRules.standard(cfg.route, n_layers=n_layers, bf16_first=cfg.rules.bf16_first,
                            bf16_last=cfg.rules.bf16_last)
  return dataclasses.replace(std, rules=RouteRules.parse(list(cfg.rules.extra)).rules)


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
