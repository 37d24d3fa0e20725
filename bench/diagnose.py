"""`python -m bench diagnose`: route diagnostics on a Llama's linears (random init, or a trained run with `--run`)
or on synthetic stress inputs.

For each input (a captured linear of `--preset` or of `--run`'s model, or a stress case with `--stress`) and each
route, runs `fp4jax.diagnostics.operand_report`: per operand role the relative squared quantization error, the
zero-code and clip fractions; per GEMM the cosine to the exact product, the single-sample relative error, the
bias of the mean over `--samples` keys and what that bias would be for an unbiased estimator (error /
sqrt(samples)). Prints a table; `--out DIR` also writes diagnose.json and diagnose.png (mean over inputs per
route). Numbers describe the inputs they were measured on: by default a random-init model on random tokens;
`--run DIR` reads the trained model of a `python -m train` run directory and feeds it held-out text of its own
data.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from bench import args as args_lib
from fp4jax import diagnostics
from fp4jax import route as route_lib
from train.errors import UserError

DEFAULT_ROUTES = ("mxfp4", "mxfp4_h32", "nvfp4", "nvfp4_tile_local", "quartet2")
DEFAULT_LINEARS = ("layers.0.attn.q", "layers.0.mlp.down")
# The defaults of the options that one kind of input reads: they parse as None when not given, so that one given
# to an input that does not read it is refused (`_check_options`) rather than ignored.
MODEL_DEFAULTS = {"preset": "tiny", "tokens": (4, 64), "linears": list(DEFAULT_LINEARS)}
STRESS_SHAPE = (128, 256, 128)
_COLUMNS = (("rel_sq_error", "relsq_err", ".2e"), ("zero_fraction", "zero", ".4f"), ("clip_fraction", "clip", ".4f"),
            ("cosine", "cosine", ".5f"), ("rel_error", "rel_err", ".4f"), ("bias", "bias", ".4f"),
            ("unbiased_bias", "unbiased", ".4f"), ("deterministic", "det", ""))


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--routes", nargs="+", type=args_lib.route(), default=list(DEFAULT_ROUTES),
                      help="routes (default: %(default)s)")
  parser.add_argument("--preset", type=args_lib.preset,
                      help=f"Llama preset, random init on random tokens (default: {MODEL_DEFAULTS['preset']})")
  parser.add_argument("--tokens", type=args_lib.tokens,
                      help="--preset's batch BATCHxSEQ (default: {}x{})".format(*MODEL_DEFAULTS["tokens"]))
  parser.add_argument("--linears", nargs="+",
                      help=f"module paths of the linears to capture, or 'all' (default: {MODEL_DEFAULTS['linears']})")
  parser.add_argument("--run", metavar="DIR",
                      help="a trained model instead: a `python -m train` run directory (its config.yaml and newest "
                           "checkpoint), on the first BATCH windows of its held-out data (--tokens BATCHxSEQ; "
                           "SEQ is the run's own data.seq_len)")
  parser.add_argument("--stress", action="store_true", help="synthetic stress inputs instead of a model")
  parser.add_argument("--shape", type=args_lib.int_at_least(1), nargs=3, metavar=("M", "K", "N"),
                      help=f"--stress's linear shape (default: {STRESS_SHAPE})")
  parser.add_argument("--samples", type=args_lib.int_at_least(1), default=16,
                      help="keys the GEMM bias is averaged over (default: 16)")
  parser.add_argument("--seed", type=args_lib.seed, default=0)
  parser.add_argument("--out", default=None, type=args_lib.out_dir,
                      help="directory for diagnose.json and diagnose.png (replaced)")


def model_inputs(preset: str, tokens: tuple[int, int], linears: list[str], seed: int
                 ) -> dict[str, diagnostics.GemmInputs]:
  """{linear path: (x, w, dy)} of a random-init bf16 Llama of `preset` on uniform random tokens."""
  from flax import nnx  # The model path only: --stress needs no Flax.

  from fp4jax.nn import RouteRules
  from fp4jax.nn.diagnostics import capture_linears
  from fp4jax.nn.llama import Llama, LlamaConfig

  batch, seq = tokens
  cfg = LlamaConfig.preset(preset, max_seq_len=seq)
  model = Llama(cfg, rules=RouteRules.standard("bf16", n_layers=cfg.n_layers), rngs=nnx.Rngs(seed))
  ids = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab_size)
  return capture_linears(model, ids, None, names=None if linears == ["all"] else linears)


def run_inputs(run_dir: str, tokens: tuple[int, int], linears: list[str], seed: int) -> tuple[dict, str]:
  """({linear path: GemmInputs (x, w, dy)}, a description) of a trained run's model (`train.restore`) on held-out
  text: the first BATCH windows of --tokens' BATCHxSEQ (SEQ is the run's own data.seq_len)."""
  from fp4jax.nn.diagnostics import capture_linears
  from train import restore  # The app that wrote the run knows its layout: config.yaml, ckpt/, data.

  trained = restore.load(run_dir, route="bf16", scan_layers=False)  # the trained weights, exact activations
  batch = tokens[0]
  ids = trained.heldout_batch(batch, log=None, asked_by="bench diagnose: --tokens")
  inputs = capture_linears(trained.model, ids, jax.random.key(seed), names=None if linears == ["all"] else linears)
  cfg = trained.config
  return inputs, (f"run {run_dir} (Llama {cfg.model.preset} at step {trained.step}, run in bf16) on {batch} x "
                  f"{cfg.data.seq_len} held-out tokens")


def _cell(row: dict, key: str, fmt: str) -> str:
  if key not in row:
    return "-"
  return ("yes" if row[key] else "no") if isinstance(row[key], bool) else format(row[key], fmt)


def table(rows: list[dict]) -> str:
  """The rows as an aligned text table: input, route, kind, role or GEMM, then the metric columns."""
  head = ["input", "route", "kind", "name", *(title for _, title, _ in _COLUMNS)]
  body = [[r["input"], r["route"], r["kind"], r["name"], *(_cell(r, k, f) for k, _, f in _COLUMNS)] for r in rows]
  widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [head, *body])


def plot(rows: list[dict], path: str) -> bool:
  """Two panels, means over inputs per route: operand rel. squared error per role, GEMM bias next to the
  unbiased expectation. Returns False (and writes nothing) when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  routes = list(dict.fromkeys(r["route"] for r in rows))
  mean = lambda kind, name, route, key: float(np.mean([r[key] for r in rows if (r["kind"], r["name"], r["route"])
                                                       == (kind, name, route)]))
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
  width = 0.8 / len(routes)
  roles, gemms = route_lib.ROLES, tuple(route_lib.GEMMS)
  for i, route in enumerate(routes):
    left.bar(np.arange(len(roles)) + i * width, [mean("operand", r, route, "rel_sq_error") for r in roles],
             width, label=route)
    right.bar(np.arange(len(gemms)) + i * width, [mean("gemm", g, route, "bias") for g in gemms], width,
              label=route, color=f"C{i}")
    right.bar(np.arange(len(gemms)) + i * width, [mean("gemm", g, route, "unbiased_bias") for g in gemms], width,
              fill=False, hatch="//", edgecolor="k")
  left.set(xticks=np.arange(len(roles)) + 0.4 - width / 2, xticklabels=roles, yscale="log",
           title="operand ||Q(v) - v||^2 / ||v||^2")
  right.set(xticks=np.arange(len(gemms)) + 0.4 - width / 2, xticklabels=gemms,
            title="GEMM bias of the mean over keys (hatched: unbiased expectation)")
  left.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _named_linears(inputs_fn, *args):
  """inputs_fn(*args), with a --linears name the model does not have as a one-line UserError (it lists them)."""
  try:
    return inputs_fn(*args)
  except ValueError as e:
    if not str(e).startswith("no FP4Linear at"):  # `capture_linears`' unknown names, nothing else
      raise
    raise UserError(f"bench diagnose: --linears: {e}") from e


def _check_options(args: argparse.Namespace) -> None:
  """A UserError naming the options given that the chosen input does not read."""
  if args.stress:
    unread, where = ("preset", "tokens", "linears"), "with --stress (they pick a model's linears)"
  elif args.run:
    unread, where = ("preset", "shape"), "with --run (its model is the run's own)"
  else:
    unread, where = ("shape",), "without --stress (it is --stress's linear shape)"
  given = [f"--{name}" for name in unread if getattr(args, name) is not None]
  if given:
    raise UserError(f"bench diagnose: {', '.join(given)} not read {where}; drop {'them' if given[1:] else 'it'}")


def run(args: argparse.Namespace) -> None:
  """Prints the diagnostics table; writes JSON and a plot under --out."""
  if args.stress and args.run:
    raise UserError("bench diagnose: --stress and --run are two different inputs; give one")
  _check_options(args)
  if args.stress:
    shape = args.shape or STRESS_SHAPE
    inputs = diagnostics.stress_cases(*shape, seed=args.seed)
    source = f"stress {tuple(shape)}"
  else:
    preset, tokens, linears = (getattr(args, name) or value for name, value in MODEL_DEFAULTS.items())
    if args.run:
      inputs, source = _named_linears(run_inputs, args.run, tokens, linears, args.seed)
    else:
      inputs = _named_linears(model_inputs, preset, tokens, linears, args.seed)
      source = f"Llama {preset} (random init) on {tokens[0]}x{tokens[1]} random tokens"
  print(f"bench diagnose: {source}, {args.samples} samples, {jax.devices()[0].platform}", flush=True)
  key = jax.random.key(args.seed)
  rows = []
  start = time.perf_counter()
  for i, (name, (x, w, dy)) in enumerate(inputs.items(), 1):
    for route in args.routes:
      rows += [{"input": name, **row} for row in diagnostics.operand_report(x, w, dy, route, key,
                                                                            samples=args.samples)]
    # Progress: the first input of each shape compiles every route's quantizers (minutes on a cold GPU host).
    print(f"  [{i}/{len(inputs)}] {name} {tuple(x.shape)} x {tuple(w.shape)}: {len(args.routes)} route(s), "
          f"{time.perf_counter() - start:.1f} s", flush=True)
  print(table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "diagnose.json"), "w") as f:
      json.dump({"source": source, "samples": args.samples, "rows": rows}, f, indent=1)
    if not plot(rows, os.path.join(args.out, "diagnose.png")):
      print("matplotlib is not installed: no plot written")
    print(f"wrote {args.out}/diagnose.json")
