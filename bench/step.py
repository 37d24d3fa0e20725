"""`python -m bench step`: one jitted Llama train step per route: tokens/s, MFU, memory, where the time goes.

  python -m bench step --preset 1b --tokens 8x2048 [--layers N] [--routes bf16 mxfp4 ...] [--iters 10]
                       [--profile] [--scan [auto] [--scan-saves outputs|operands]] [--attention auto|xla|cudnn]
                       [--unfused-linears] [--microbatches N]
                       [--out step.json] [--hlo DIR]

The step is `python -m train`'s: next-token cross-entropy and its gradient (`train.objective.loss_and_grads`: in
`--microbatches` sequential passes, as `data.microbatches` does), AdamW, the state donated;
bf16 compute, float32 parameters, the route on every block linear (embedding and lm_head stay bf16). Tokens
are uniform random ids (the step's speed does not depend on their values). `--layers` keeps a preset's layer
shapes with fewer layers (`--preset llama3_8b --layers 8`: Llama-3-8B blocks on one GPU). Besides fp4jax's
routes, `--routes flax_fp8` runs the ecosystem's FP8 peer: Flax's own FP8 op with its delayed-scaling state on
every block linear (`bench.flax_fp8`; linears unfused).

Columns:
  compile  seconds of lowering + compiling the step (cold unless the persistent cache holds it: `python -m
           bench --compile-cache off step ...` for a cold compile)
  tokens/s batch x seq / median step time (steps run back to back, as in training)
  MFU      model FLOPs / step time / the device's dense bf16 peak, for every route (FP4 routes are scored on
           the same FLOPs, so MFU ratios equal tokens/s ratios). Model FLOPs per token: 6 N + 6 L T d, with N
           the parameters of every matmul (blocks and lm_head; the embedding lookup is no matmul), L layers,
           T the sequence length and d the model width (causal attention's QK^T and PV, forward and backward,
           half of the T x T square).
  memory   XLA's plan for the compiled step: arguments + outputs + temporaries - donated buffers, in GiB
`--profile` adds the time per step by category (`bench.breakdown`) from a profile of three steps, and the kernels,
GEMM instructions (with their shapes) and copied instructions that took the most time (`top_kernels`, `top_gemms`,
`top_copies` in the JSON; the first five kernels per route are printed). With bf16 profiled too, each other route
gets a line (and `against_bf16` in the JSON, `breakdown.against_bf16`): its step with bf16's time for everything
but its GEMMs, the "x bf16" that would give, and what its step spends over that (quantizers, FP4 glue, copies, the
rest); none (null) where the profile and the timing disagree too much for a bound (a loaded machine). The profile
runs a second compile of the step with XLA's command buffers off (`PROFILE_OPTIONS`).
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bench import args as args_lib
from bench import breakdown, dot, flax_fp8
from fp4jax import Impl, compiling, platform
from fp4jax.ops import gemm as gemm_lib
from train import build, metrics, objective
from train.errors import UserError

# Dense bf16 tensor-core peak by `device_kind` (NVIDIA datasheets, SXM parts, no sparsity).
PEAK_BF16_FLOPS = {"NVIDIA H200": 989.4e12, "NVIDIA H100 80GB HBM3": 989.4e12}
ATTENTION = ("auto", "xla", "cudnn")
# XLA options of the profiled executable (`measure`): no command buffers, so every kernel's event names its HLO
# instruction. (The 2026-12-02 H200 profiles, taken with them on, fell back to kernel names for most events.)
PROFILE_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


DEFAULT_ROUTES = ("bf16", "fp8", flax_fp8.NAME, "mxfp4", "mxfp4_h32", "nvfp4")
TOP = 15  # --profile: the kernels and GEMMs the JSON lists


def _flax_in_one_pass() -> UserError:
  return UserError(f"bench step: --routes {flax_fp8.NAME} runs in one pass (its FP8 state updates per pass); drop "
                   f"--microbatches or that route")


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--preset", type=args_lib.preset, default="125m",
                      help="Llama preset (fp4jax.nn.llama PRESETS)")
  parser.add_argument("--layers", type=args_lib.int_at_least(1),
                      help="keep the preset's layer shapes with this many layers")
  parser.add_argument("--tokens", type=args_lib.tokens, default="8x1024",
                      help="batch: BATCHxSEQ (default: %(default)s)")
  parser.add_argument("--routes", nargs="+", type=args_lib.route(flax_fp8.NAME), default=list(DEFAULT_ROUTES),
                      help=f"fp4jax routes, or {flax_fp8.NAME} (Flax's FP8 op, `bench.flax_fp8`); "
                           f"default: %(default)s")
  parser.add_argument("--iters", type=args_lib.int_at_least(1), default=10, help="timed steps per route")
  args_lib.add_scan(parser)
  parser.add_argument("--scan-saves", default="outputs", choices=("outputs", "operands"),
                      help="what a scanned block keeps for its backward (fp4jax.nn.llama.model.SCAN_POLICIES)")
  parser.add_argument("--attention", choices=ATTENTION, default="auto", help="Llama attention_impl")
  parser.add_argument("--gemm", choices=gemm_lib.CHOICES, default="auto",
                      help="the FP4 GEMM backend (fp4jax.Impl(gemm=...); default: %(default)s)")
  parser.add_argument("--unfused-linears", action="store_true",
                      help="one product per linear (LlamaConfig.fuse_linears=False), not q|k|v and gate|up fused")
  parser.add_argument("--unfused-producers", action="store_true",
                      help="the MLP's SwiGLU written out before the down projection's quantizer reads it "
                           "(fp4jax.Impl(fuse_producers=False)), not computed in the quantizer's pass")
  parser.add_argument("--microbatches", type=args_lib.int_at_least(1), default=1, metavar="N",
                      help="split each step's batch into N sequential passes, gradients averaged (train's "
                           "data.microbatches; default: %(default)s)")
  parser.add_argument("--profile", action="store_true", help="add the time breakdown by category")
  parser.add_argument("--top", type=args_lib.int_at_least(1), metavar="N",
                      help=f"with --profile: how many kernels and GEMMs the JSON lists (default: {TOP})")
  parser.add_argument("--out", type=args_lib.out_file, help="write the rows as JSON to this file (replaced)")
  parser.add_argument("--hlo", metavar="DIR", type=args_lib.out_dir,
                      help="write each route's compiled step (optimized HLO text) here")


class LlamaStep(NamedTuple):
  """What `llama_step` builds. `step(state, tokens, i) -> (state, loss)`; `create()` returns freshly initialized
  state; `state` and `tokens` are their abstract values; `scanned`: whether the blocks run as a scanned body
  (the model's own decision for `scan="auto"`)."""

  step: Callable
  create: Callable
  state: Any
  tokens: jax.ShapeDtypeStruct
  config: Any
  scanned: bool


def llama_step(preset: str, route: str, *, batch: int, seq: int, scan: bool | str = False, impl: Impl = Impl(),
               layers: int | None = None, attention: str = "auto", scan_saves: str = "outputs",
               fuse_linears: bool = True, microbatches: int = 1) -> LlamaStep:
  """The train step of a Llama preset with `route` on its blocks' linears: cross-entropy, backward (in
  `microbatches` sequential passes) and AdamW as `python -m train` does. `scan`: `Llama`'s `scan_layers` (True,
  False, or "auto": scanned where the blocks' linears quantize; flax_fp8, whose linears are bf16 ones converted
  to Flax's FP8 op, always runs them unrolled)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.nn import RouteRules  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama import Llama, LlamaConfig  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama.layers import check_cudnn_head_dim  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama.model import SCAN_POLICIES  # pylint: disable=g-import-not-at-top
  flax = route == flax_fp8.NAME  # Flax's FP8 op on bf16 linears, with its delayed-scaling state
  overrides = {"n_layers": layers} if layers else {}
  if batch % microbatches:
    raise UserError(f"bench step: the batch of {batch} sequences does not split into --microbatches "
                    f"{microbatches} equal passes")
  scan = False if flax else scan  # Flax's FP8 state is per linear of unrolled blocks (`flax_fp8.convert`)
  if flax and microbatches > 1:
    raise _flax_in_one_pass()
  if attention == "cudnn" and jax.default_backend() != "gpu":
    raise UserError(f"bench step: --attention cudnn needs a GPU (this backend: {jax.default_backend()}); use auto "
                    f"or xla")
  cfg = LlamaConfig.preset(preset, max_seq_len=seq, attention_impl=attention,
                           fuse_linears=fuse_linears and not flax, **overrides)
  if attention == "cudnn":  # else its first call fails when the step is traced
    try:
      check_cudnn_head_dim(cfg.head_dim, "bench step: --attention cudnn")
    except ValueError as err:
      raise UserError(f"{err} (preset {preset}: dim={cfg.dim} // n_heads={cfg.n_heads}); use --attention auto or "
                      f"xla") from err
  rules = RouteRules.standard("bf16" if flax else route, n_layers=cfg.n_layers, bf16_first=0, bf16_last=0)
  tx = optax.adamw(1e-4)

  def create():
    model = Llama(cfg, rules=rules, rngs=nnx.Rngs(0), impl=impl, dtype=jnp.bfloat16, scan_layers=scan,
                  scan_policy=SCAN_POLICIES[scan_saves])
    if flax:
      flax_fp8.convert(model)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  abstract_model, abstract_optimizer = nnx.eval_shape(create)
  graphdef, abstract = nnx.split((abstract_model, abstract_optimizer))
  base_key = jax.random.key(0)

  def train_step(state, tokens, i):
    model, optimizer = nnx.merge(graphdef, state)
    key = jax.random.fold_in(base_key, i)
    if flax:  # the FP8 state's "gradients" are its next values: written back, not optimized
      wrt = nnx.DiffState(0, (nnx.Param, flax_fp8.Fp8Meta))
      loss, grads = nnx.value_and_grad(objective.cross_entropy, argnums=wrt)(model, tokens, key)
      grads, fp8_state = flax_fp8.split_grads(grads)
      nnx.update(model, fp8_state)
    else:
      loss, grads = objective.loss_and_grads(model, tokens, key, microbatches)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  return LlamaStep(train_step, lambda: nnx.split(create())[1], state, tokens, cfg, abstract_model.scan_layers)


def flops_per_token(cfg, seq: int) -> float:
  """Model FLOPs per trained token (module doc): 6 N + 6 L T d."""
  matmul_params = cfg.num_params() - cfg.vocab_size * cfg.dim * (0 if cfg.tie_embeddings else 1)
  matmul_params -= cfg.dim * (2 * cfg.n_layers + 1)  # RMSNorm scales are no matmul
  return 6 * matmul_params + 6 * cfg.n_layers * seq * cfg.dim


def _is_oom(err: Exception) -> bool:
  text = str(err)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure(route: str, args: argparse.Namespace, batch: int, seq: int) -> dict:
  """One route's row: compile seconds, step seconds, tokens/s, MFU, memory and (with --profile) breakdown."""
  step_fn, create, abstract, tokens_spec, cfg, scan = llama_step(
      args.preset, route, batch=batch, seq=seq, scan=args.scan, layers=args.layers, attention=args.attention,
      scan_saves=args.scan_saves, fuse_linears=not args.unfused_linears, microbatches=args.microbatches,
      impl=Impl(gemm=args.gemm, fuse_producers=not args.unfused_producers))
  row = {"route": route, "preset": args.preset, "layers": cfg.n_layers, "batch": batch, "seq": seq,
         "scan": scan, "scan_saves": args.scan_saves if scan else None, "attention": args.attention,
         "gemm": args.gemm, "fused_linears": cfg.fuse_linears, "fused_producers": not args.unfused_producers,
         "microbatches": args.microbatches}
  t0 = time.perf_counter()
  with platform.old_objects_frozen():  # as train compiles
    compiled, report = compiling.compile_program(jax.jit(step_fn, donate_argnums=0), abstract, tokens_spec,
                                                 jax.ShapeDtypeStruct((), jnp.int32), **args_lib.kernels_first(args))
  row["compile_s"] = time.perf_counter() - t0
  row["kernels_first"], row["kernels_first_ready_s"] = report.kernels, report.ready_s
  _progress(route, f"compiled in {row['compile_s']:.1f} s" + (f" ({report.summary()})" if report.summary() else ""))
  if args.hlo:
    path = pathlib.Path(args.hlo) / (f"{args.preset}_{cfg.n_layers}l_{batch}x{seq}_"
                                     f"{'scan_' + args.scan_saves if scan else 'unrolled'}_{route}.hlo.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(compiled.as_text())
  row["memory_bytes"] = metrics.planned_bytes(compiled)
  t0 = time.perf_counter()
  init = platform.compile_initializer(create)
  t1 = time.perf_counter()
  state = jax.block_until_ready(init())
  _progress(route, f"state initialized in {time.perf_counter() - t0:.1f} s (compile {t1 - t0:.1f} s, "
            f"run {time.perf_counter() - t1:.1f} s)")
  tokens = jax.random.randint(jax.random.key(1), tokens_spec.shape, 0, cfg.vocab_size, jnp.int32)
  i = 0
  t0 = time.perf_counter()
  for _ in range(2):  # Warm-up: first-run allocations and autotuned kernels' first launches.
    state, loss = compiled(state, tokens, jnp.int32(i))
    i += 1
  jax.block_until_ready(loss)
  _progress(route, f"2 warm-up steps in {time.perf_counter() - t0:.1f} s")
  times = []
  for _ in range(3):  # Three batches of back-to-back steps; the median batch's time per step.
    t0 = time.perf_counter()
    for _ in range(args.iters):
      state, loss = compiled(state, tokens, jnp.int32(i))
      i += 1
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - t0) / args.iters)
  step_s = statistics.median(times)
  row.update(step_s=step_s, tokens_per_s=batch * seq / step_s, loss=float(loss),
             flops_per_token=flops_per_token(cfg, seq))
  peak = PEAK_BF16_FLOPS.get(jax.devices()[0].device_kind)
  row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None
  if args.profile:
    # A second compile of the same step with XLA's command buffers (CUDA graphs) off: inside a graph a kernel's
    # profile event names the graph, not its HLO instruction, and the categories come from the instruction.
    # Kernel durations are the graph's; only the launch gaps between them may differ.
    _progress(route, f"{args.iters * 3 + 2} steps timed; compiling again to profile")
    t_profile = time.perf_counter()
    profiled = jax.jit(step_fn, donate_argnums=0).lower(
        abstract, tokens_spec, jax.ShapeDtypeStruct((), jnp.int32)).compile(compiler_options=PROFILE_OPTIONS)
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):
        for _ in range(3):
          state, loss = profiled(state, tokens, jnp.int32(i))
          i += 1
        jax.block_until_ready(loss)
      xplane = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0]
      events = breakdown.device_events(xplane, module="train_step")
    hlo_text = profiled.as_text()
    attributed = breakdown.attribute(hlo_text, events)
    seconds, unattributed = breakdown.breakdown(attributed)
    row["breakdown_s"] = {k: v / 3 for k, v in seconds.items()}
    row["unattributed_top"] = [(op, kernel, s / 3) for op, kernel, s in unattributed]
    row["top_kernels"] = [(category, kernel, s / 3)
                          for category, kernel, s in breakdown.top_kernels(attributed, args.top or TOP)]
    row["top_gemms"] = [(category, signature, kernel, s / 3) for category, signature, kernel, s
                        in breakdown.top_gemms(attributed, breakdown.gemm_signatures(hlo_text), args.top or TOP)]
    row["top_copies"] = [(op, text, op_name, s / 3) for op, text, op_name, s
                         in breakdown.top_copies(attributed, hlo_text, args.top or TOP)]
    _progress(route, f"profiled in {time.perf_counter() - t_profile:.0f} s")
  del state
  return row


def _progress(route: str, message: str) -> None:
  print(f"  [{route}] {message}", file=sys.stderr, flush=True)


def _table(rows: list[dict]) -> str:
  base = {(r["preset"], r["layers"]): r["tokens_per_s"] for r in rows if r["route"] == "bf16" and "step_s" in r}
  # Under `--scan auto` the rows differ in how their blocks run: the route column says so.
  mixed = len({r.get("scan") for r in rows if "error" not in r}) > 1
  label = lambda r: f"{r['route']} ({'scanned' if r['scan'] else 'unrolled'})" if mixed else r["route"]
  lines = [f"{'route':18s} {'compile s':>9s} {'ms/step':>8s} {'tokens/s':>10s} {'x bf16':>7s} {'MFU':>6s} "
           f"{'GiB':>6s}"]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['route']:18s} {r['error']}")
      continue
    ratio = r["tokens_per_s"] / base[(r["preset"], r["layers"])] if (r["preset"], r["layers"]) in base else None
    mem = f"{r['memory_bytes'] / 2**30:6.1f}" if r["memory_bytes"] is not None else "   n/a"
    lines.append(f"{label(r):18s} {r['compile_s']:9.1f} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:10,.0f} "
                 f"{'' if ratio is None else f'{ratio:7.2f}':>7s} "
                 f"{'' if r['mfu'] is None else f'{r['mfu']:6.1%}':>6s} {mem}")
  profiled = [r for r in rows if "breakdown_s" in r]
  if profiled:
    cats = [c for c in (*breakdown.CATEGORIES, "unattributed") if any(r["breakdown_s"][c] for r in profiled)]
    lines.append("")
    lines.append(f"{'ms per step':18s} " + " ".join(f"{c:>13s}" for c in cats) + f" {'busy':>8s} {'step':>8s}")
    for r in profiled:
      b = r["breakdown_s"]
      lines.append(f"{r['route']:18s} " + " ".join(f"{b[c] * 1e3:13.2f}" for c in cats)
                   + f" {sum(b.values()) * 1e3:8.2f} {r['step_s'] * 1e3:8.2f}")
    for r in profiled:
      if "against_bf16" not in r:
        continue
      a = r["against_bf16"]
      if a is None:
        lines.append(f"{r['route']}: no bound against bf16: the profiled GEMMs do not fit in bf16's timed step "
                     f"(noisy runs: a loaded machine, or too few --iters)")
        continue
      parts = ", ".join(f"{name} {s * 1e3:.1f}" for name, s in a["overhead_parts_s"].items())
      lines.append(f"{r['route']}: with bf16's time for all but its GEMMs {a['bound_s'] * 1e3:.1f} ms, "
                   f"{a['bound_x']:.2f}x bf16; the {a['overhead_s'] * 1e3:.1f} ms over that: {parts}")
    for r in profiled:
      lines.append(f"top kernels, {r['route']} (ms per step): " + "; ".join(
          f"{kernel[:48]} [{category}] {s * 1e3:.2f}" for category, kernel, s in r["top_kernels"][:5]))
  return "\n".join(lines)


def _add_bounds(rows: list[dict]) -> None:
  """Sets "against_bf16" (`breakdown.against_bf16`) on each profiled row of a quantized route whose preset and
  layers have a profiled bf16 row."""
  base = {(r["preset"], r["layers"]): r for r in rows if r["route"] == "bf16" and "breakdown_s" in r}
  for r in rows:
    b = base.get((r["preset"], r["layers"]))
    if r["route"] != "bf16" and "breakdown_s" in r and b is not None:
      r["against_bf16"] = breakdown.against_bf16(r["breakdown_s"], r["step_s"], b["breakdown_s"], b["step_s"])


def _blocks(args: argparse.Namespace) -> str:
  """How the blocks run, for the header line."""
  saving = f"saving {args.scan_saves}"
  if args.scan == "auto":
    return f"blocks scanned ({saving}) for quantized routes, unrolled for bf16 (as training's scan_layers: auto)"
  return f"scanned ({saving})" if args.scan else "unrolled"


def _check(args: argparse.Namespace) -> None:
  """What a later route's step would refuse, refused before the first route runs (a UserError), or, for the
  default routes, the one route that cannot run left out with a note. (A batch that does not split into the
  microbatches fails in the first route's `llama_step`, before any work.)"""
  if args.microbatches > 1 and flax_fp8.NAME in args.routes:
    if tuple(args.routes) != DEFAULT_ROUTES:
      raise _flax_in_one_pass()
    args.routes = [r for r in args.routes if r != flax_fp8.NAME]
    print(f"bench step: {flax_fp8.NAME} left out of the default routes: it runs in one pass, not "
          f"--microbatches {args.microbatches}", flush=True)
  if args.scan_saves != "outputs" and not args.scan:
    raise UserError("bench step: --scan-saves chooses what scanned blocks keep; add --scan (or --scan auto)")
  if args.top is not None and not args.profile:
    raise UserError("bench step: --top sets how many kernels and GEMMs --profile lists; add --profile")
  build.check_impl(Impl(gemm=args.gemm), [r for r in args.routes if r != flax_fp8.NAME], "bench step: --gemm")


def run(args: argparse.Namespace) -> None:
  """Measures each route in turn (an out-of-memory route becomes a row saying so), printing the table after each."""
  _check(args)
  batch, seq = args.tokens
  layers = f", {args.layers} layers" if args.layers else ""
  print(f"bench step: {dot.device_info()} preset {args.preset}{layers}, {batch}x{seq} tokens, "
        f"{_blocks(args)}, attention {args.attention}, "
        f"linears {'unfused' if args.unfused_linears else 'fused'}"
        f"{', SwiGLU written out' if args.unfused_producers else ''}"
        f"{f', {args.microbatches} microbatches per step' if args.microbatches > 1 else ''}", flush=True)
  rows = []
  for route in args.routes:
    try:
      row = measure(route, args, batch, seq)
    except Exception as err:  # pylint: disable=broad-except
      if not _is_oom(err):
        raise
      row = {"route": route, "preset": args.preset, "layers": args.layers, "error": "out of memory"}
    rows.append(row)
    _add_bounds(rows)
    print(_table(rows), flush=True)  # the table so far: a long run stopped midway still reports its routes
    if args.out:
      with open(args_lib.made_parent(args.out), "w") as f:
        json.dump({"info": dot.device_info(), "rows": rows}, f, indent=1)
