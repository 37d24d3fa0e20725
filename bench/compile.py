"""`python -m bench compile`: where compile time goes, per route.

  python -m bench compile [--shapes 0] [--routes ...]                fp4_dot forward and forward+backward
  python -m bench compile --step 30m [--tokens 8x512] [--scan] [--h200] [--routes ...]   a whole train step

Each row splits the first call into its phases: tracing (Python: jaxpr of the step), lowering (StableHLO, with
every Pallas kernel's Triton IR) and XLA compilation (passes, GEMM autotuning, Triton -> PTX of each kernel),
and counts the Pallas kernels in the lowered module (call sites; distinct Triton IR). The train step is a Llama
preset's forward, backward and AdamW update (bf16 compute, the route on every linear but the embedding and
lm_head). `--h200` lowers for an abstract H200 on any machine (no compile phase): tracing and lowering are host
work, so their seconds carry over to the GPU machine's host roughly as the CPUs compare.

Compiles are cold (the persistent cache is off) unless `--warm`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time

import jax
import jax.numpy as jnp
import optax

from bench import dot, triton
from fp4jax import Impl, platform


def add_args(parser: argparse.ArgumentParser) -> None:
  dot.add_shape_args(parser)
  parser.add_argument("--warm", action="store_true",
                      help="keep the persistent compilation cache on (default: off, every compile is cold)")
  parser.add_argument("--step", metavar="PRESET", help="time a whole Llama train step of this preset instead")
  parser.add_argument("--tokens", default="8x512", help="--step's batch: BATCHxSEQ (default: %(default)s)")
  parser.add_argument("--scan", action="store_true", help="--step: run same-route blocks as one scanned body")
  parser.add_argument("--h200", action="store_true", help="lower for an abstract H200 (any machine; no compile)")


def kernel_counts(lowered_text: str) -> tuple[int, int]:
  """(Pallas kernel call sites, distinct kernels) in a lowered module's text."""
  irs = re.findall(r'ir = "([^"]*)"', lowered_text)
  return len(irs), len(set(irs))


def _phases(fn, args, *, h200: bool) -> dict:
  """Seconds of trace, lower and compile of `jax.jit(fn)(*args)` and the kernel counts."""
  target = triton.on_abstract_h200() if h200 else contextlib.nullcontext()
  with target:
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",)) if h200 else traced.lower()
    t2 = time.perf_counter()
  compile_s = None
  if not h200:
    lowered.compile()
    compile_s = time.perf_counter() - t2
  sites, distinct = kernel_counts(lowered.as_text())
  return {"trace": t1 - t0, "lower": t2 - t1, "compile": compile_s, "sites": sites, "distinct": distinct}


def _line(name: str, p: dict) -> str:
  compiled = "   n/a" if p["compile"] is None else f"{p['compile']:6.1f}"
  return (f"  {name:44s} trace {p['trace']:6.1f} s  lower {p['lower']:6.1f} s  compile {compiled} s  "
          f"pallas kernels {p['sites']} sites / {p['distinct']} distinct")


def train_step_fn(preset: str, route: str, *, batch: int, seq: int, scan: bool, impl: Impl):
  """(step(state, tokens, step) -> (state, loss), abstract state, abstract tokens) of a Llama preset with
  `route` on its blocks' linears: cross-entropy, backward, AdamW, as `python -m train` runs it."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.nn import RouteRules  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama import Llama, LlamaConfig  # pylint: disable=g-import-not-at-top
  cfg = LlamaConfig.preset(preset, max_seq_len=seq)
  rules = RouteRules.standard(route, n_layers=cfg.n_layers, bf16_first=0, bf16_last=0)
  tx = optax.adamw(1e-3)

  def create():
    model = Llama(cfg, rules=rules, rngs=nnx.Rngs(0), impl=impl, dtype=jnp.bfloat16, scan_layers=scan)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  base_key = jax.random.key(0)

  def loss_fn(model, tokens, key):
    logits = model(tokens[:, :-1], key=key)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

  def step(state, tokens, i):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, jax.random.fold_in(base_key, i))
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  return step, state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def run(args: argparse.Namespace) -> None:
  """Prints one line per route (and per shape and direction for fp4_dot) with the phases of its first call."""
  if not args.warm:
    platform.enable_compilation_cache(None)
  where = "abstract H200 (lowering only)" if args.h200 else dot.device_info()
  print(f"bench compile: {where} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  key = jax.random.key(0)
  if args.step:
    batch, seq = (int(v) for v in args.tokens.split("x"))
    for route in args.routes:
      step, state, tokens = train_step_fn(args.step, route, batch=batch, seq=seq, scan=args.scan, impl=Impl())
      name = f"{args.step} {'scanned' if args.scan else 'unrolled'} {batch}x{seq} {route}"
      print(_line(name, _phases(step, (state, tokens, jax.ShapeDtypeStruct((), jnp.int32)), h200=args.h200)),
            flush=True)
    return
  shapes, m = dot.selected_shapes(args)
  for sname, k, n in shapes:
    x, w, dy = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n)))
    for route in args.routes:
      fwd, fwd_bwd = dot.fp4_dot_fns(route, key)
      for name, fn, fargs in (("fwd", fwd, (x, w)), ("fwd+bwd", fwd_bwd, (x, w, dy))):
        print(_line(f"{sname} {route} {name}", _phases(fn, fargs, h200=args.h200)), flush=True)
