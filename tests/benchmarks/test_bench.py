"""The benchmark app runs end to end on CPU (tiny shapes, interpret mode) and parses what it must."""

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bench import compile as compile_bench
from bench import breakdown, dot, flax_fp8, program, quantize, step, timing, triton
from bench.__main__ import main
from fp4jax import compiling, platform

_CUDA_PLUGIN = compile_bench.cuda_plugin_installed()
# `--h200` without `--xla` only lowers, for an abstract H200: where JAX's CUDA plugin is installed (any GPU host) the
# step takes cuDNN's attention, whose call lowers only with a device, and bench says to add --xla instead.
_LOWERS_CUDNN = "JAX's CUDA plugin is installed: the step's cuDNN attention lowers only with --xla"


def test_hlo_check_parser():
  text = ('%c = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,32]{1,0} %a, f8e4m3fn[8,32]{1,0} %b), '
          'custom_call_target="__cublas$lt$matmul$f8"\n'
          '%d = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(bf16[8,32]{1,0} %a, bf16[8,32]{1,0} %b), '
          'custom_call_target="__cublas$gemm"')
  assert dot.cublas_fp8_gemms(text) == ["__cublas$lt$matmul$f8"]
  by_name = ('%p.1 = f8e4m3fn[8,32]{1,0} parameter(0)\n%f = f8e4m3fn[8,32]{1,0} fusion(%x), kind=kLoop\n'
             'ROOT %c.2 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%p.1, %f), '
             'custom_call_target="__cublas$lt$matmul$f8"\n'
             '%g = bf16[8,32]{1,0} parameter(1)\n'
             '%d = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%g, %g), custom_call_target="__cublas$lt$matmul"')
  assert dot.cublas_fp8_gemms(by_name) == ["__cublas$lt$matmul$f8"]

def test_bench_dot_small_smoke(tmp_path, capsys):
  out = tmp_path / "new" / "dot.json"  # a folder that --out's writer makes
  main(["dot", "--small", "--shapes", "2", "--routes", "bf16", "--iters", "1", "--warmup", "1",
              "--out", str(out)])
  printed = capsys.readouterr().out
  assert "HLO check" in printed and "fp4 gemm fp8 backend MXFP4" in printed
  rows = json.loads(out.read_text())["rows"]
  assert all("ms" in r for r in rows), [r for r in rows if "ms" not in r]
  assert {r["name"] for r in rows} >= {"bf16 dot", "fp8 per-tensor dot (fast accum)",
                                       "fp4 gemm fp8 backend MXFP4", "fp4 gemm fp8 backend NVFP4 (bf16)",
                                       "fp4 gemm emulated MXFP4"}
  checks = json.loads(out.read_text())["check_vs_emulated"]
  assert all(c["nan_pattern_equal"] and c["max_diff_over_bound"] <= 1 for c in checks.values())

def test_bench_compile_small_smoke(capsys):
  main(["compile", "--small", "--shapes", "0", "--routes", "mxfp4"])
  lines = [l for l in capsys.readouterr().out.splitlines() if "mxfp4" in l and "compile" in l]
  assert [l.split()[3] for l in lines] == ["fwd", "fwd+bwd"], lines


def test_bench_compile_passes_lists_xla_compile_events(capsys):
  main(["--compile-cache", "off", "compile", "--small", "--shapes", "0", "--routes", "bf16", "--passes", "3"])
  out = capsys.readouterr().out.splitlines()
  events = [l for l in out if re.match(r"\s+\d+\.\d+ s\s+\d+x  \S", l)]
  assert len(events) == 6, events  # three per compile, forward and forward + backward
  assert not any("$" in l for l in events)  # XLA's events, not Python frames
  singles = [re.match(r"\s+(\d+\.\d+) s  at\s+(\d+\.\d+) s  .{24}  (\S.*)$", l) for l in out]
  singles = [(float(m.group(1)), m.group(3)) for m in singles if m]
  assert len(singles) == 6, out  # the three longest single events of each compile
  seconds = [s for s, _ in singles[:3]]
  assert seconds == sorted(seconds, reverse=True), singles  # longest first
  assert len([l for l in out if l.strip().startswith("threads: calling (")]) == 2, out  # one per compile


def test_bench_compile_kernels_on_a_cpu_finds_no_launch(capsys):
  """`--kernels` on a CPU: the kernels run in interpret mode, no Triton launch compiles alone (one line per
  compile says so)."""
  main(["--compile-cache", "off", "compile", "--small", "--shapes", "0", "--routes", "mxfp4", "--kernels"])
  out = capsys.readouterr().out.splitlines()
  assert [l.strip() for l in out if "pallas launches" in l] == ["pallas launches compiled alone: none"] * 2, out


def test_kernel_compiles_lists_each_launch_slowest_first(monkeypatch):
  """`bench compile --kernels`: one row per distinct Triton call, slowest first, named without its launch digest,
  with its block count, largest operand and program size; the printed lines follow the rows."""
  calls = [compiling.TritonCall("fp4jax_amax_0123456789abk", "d1", 8, ("tensor<4xui32>", "tensor<64x32xf32>"),
                                b"x" * 2000),
           compiling.TritonCall("fp4jax_quantize_dual_abcdefabcdefk", "d2", 16,
                                ("tensor<2x16xf32>", "tensor<32x2x64xbf16>", "tensor<f32>"), b"x" * 30000)]
  seconds = {calls[0].name: 0.25, calls[1].name: 0.5}
  monkeypatch.setattr(compiling, "triton_calls", lambda lowered: calls)
  monkeypatch.setattr(compiling, "compile_alone", lambda call, device: seconds[call.name])
  rows = compile_bench.kernel_compiles(None, None)
  assert [(r["kernel"], r["blocks"], r["operand"], r["bytes"], r["seconds"]) for r in rows] == [
      ("fp4jax_quantize_dual", 16, "tensor<32x2x64xbf16>", 30000, 0.5),
      ("fp4jax_amax", 8, "tensor<64x32xf32>", 2000, 0.25)]
  lines = compile_bench._kernels_lines(rows)  # pylint: disable=protected-access
  assert "2 in 0.8 s, slowest 0.50 s" in lines[0]
  assert lines[1].split() == ["0.50", "s", "fp4jax_quantize_dual", "16", "blocks", "largest", "operand",
                              "tensor<32x2x64xbf16>", "30", "kB", "of", "program"]


def test_compile_events_single_events_sum_to_the_totals():
  """The single events of `compile_events` are the events its totals sum by name."""
  lowered = jax.jit(lambda a: jnp.sin(a) @ a).trace(jax.ShapeDtypeStruct((64, 64), jnp.float32)).lower()
  _, totals, singles, _ = compile_bench.compile_events(lowered)
  by_name = collections.defaultdict(float)
  for event in singles:
    by_name[event.name] += event.seconds
  assert totals and {name: round(s, 9) for name, _, s in totals} == {n: round(s, 9) for n, s in by_name.items()}
  assert all(e.start >= 0 and e.seconds >= 0 and e.thread for e in singles)
  assert [e.seconds for e in singles] == sorted((e.seconds for e in singles), reverse=True)


def test_thread_use_counts_nested_events_once():
  """`thread_use`: a thread's busy seconds sum its outermost events only (XLA's events nest on a thread), its
  span runs from its first start to its last end, its longest job is an outermost event; `threads_line` names the
  thread of the longest event as the calling one and sums the others (the compile pool)."""
  ev = compile_bench.CompileEvent
  events = [ev("compile", "python", 0.0, 10.0), ev("passes", "python", 0.5, 2.0), ev("pass", "python", 0.6, 1.0),
            ev("module", "tf_1", 3.0, 1.0), ev("ptxas", "tf_1", 3.5, 0.5), ev("module", "tf_1", 5.0, 2.5),
            ev("triton", "tf_2", 4.0, 0.75), ev("ptxas", "tf_2", 4.25, 0.5)]
  use = compile_bench.thread_use(events)
  assert use["python"] == compile_bench.ThreadUse(10.0, 0.0, 10.0, events[0])
  assert use["tf_1"] == compile_bench.ThreadUse(3.5, 3.0, 7.5, events[5])
  assert use["tf_2"] == compile_bench.ThreadUse(0.75, 4.0, 4.75, events[6])
  assert compile_bench.threads_line(use) == ("threads: calling (python) 0.00-10.00 s; 2 others busy 4.25 s in all, "
                                             "from 3.00 to 7.50 s, longest job 2.50 s (module)")
  alone = compile_bench.thread_use(events[:3])
  assert compile_bench.threads_line(alone) == "threads: calling (python) 0.00-10.00 s; no other thread"


def test_xla_kernels_counts_fusions_once_each():
  """`xla_kernels`: a fusion marked deduplicated_name launches another's kernel; tuple-shaped fusions and a ROOT
  fusion count (XLA:GPU compiled the program below into one, which counted 0); the fused computations' own
  instructions and custom calls do not. On a real compile: at least one kernel."""
  text = "\n".join([
      "%fused_add (p: f32[4]) -> f32[4] {",
      "  ROOT %add.1 = f32[4]{0} add(%p, %p)",
      "}",
      "ENTRY %main (a: f32[4]) -> f32[4] {",
      '  %loop_add_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add',
      '  %loop_add_fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_add.1, '
      'metadata={deduplicated_name="loop_add_fusion"}',
      '  %input_reduce_fusion = (f32[], f32[4]{0}) fusion(%a), kind=kInput, calls=%fused_reduce',
      '  %cublas-gemm.1 = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%a), custom_call_target="__cublas$gemm"',
      '  ROOT %triton_softmax.1 = f32[4]{0} fusion(%a), kind=kCustom, calls=%triton_softmax_computation.1',
      "}"])
  assert compile_bench.xla_kernels(text) == 3
  compiled = jax.jit(lambda a: jnp.sin(a) + jnp.sum(a)).trace(jax.ShapeDtypeStruct((64,), jnp.float32)).lower()
  assert compile_bench.xla_kernels(compiled.compile().as_text()) >= 1


def test_bench_quantize_interpret_new_variants(tmp_path, capsys):
  # The per-view and NVFP4 variants check bit for bit against the reference, here in interpret mode.
  rc = main(["quantize", "--interpret", "--shapes", "64x128", "--variants",
             "views dY sr|rne,nv dY sr|rne,sr/noclip+fp8,nv dY sr|sr+rht16 values", "--out", str(tmp_path)])
  table = capsys.readouterr().out
  assert rc == 0 and "fused views dY sr|rne" in table and "fused nv dY sr|rne" in table
  assert "fused nv dY sr|sr+rht16 values" in table
  assert "fused sr/noclip+fp8" in table and "to_fp8 8x16w4" in table
  assert "MISMATCH" not in table and "FAILED" not in table


def test_bench_quantize_interpret_is_a_small_smoke_run(capsys):
  """--interpret without --shapes takes the small smoke shape (it kept the GPU's 16384-row shapes: minutes
  per variant on a CPU)."""
  assert main(["quantize", "--interpret", "--variants", "rne/ocp"]) == 0
  table = capsys.readouterr().out
  assert "128x256" in table and "16384x" not in table, table


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU only")
def test_bench_quantize_off_a_gpu_asks_for_interpret_mode(capsys):
  """Without --interpret the kernels compile for a GPU: off one, that is one line and exit status 2 before any
  work, not a FAILED row per variant (each failing alike) and exit status 1."""
  assert main(["quantize", "--shapes", "64x128", "--variants", "rne/ocp"]) == 2
  out, err = capsys.readouterr()
  assert "FAILED" not in out and err.strip().count("\n") == 0, (out, err)
  assert re.search(r"fused kernels compile for a GPU \(this backend: cpu\); add --interpret", err), err


def test_bench_quantize_rejects_unknown_variants_and_knows_the_gpu_script_ones(capsys):
  assert main(["quantize", "--interpret", "--variants", "rne/ocp,nv rne|rnee"]) == 2  # not 1: a failed check
  assert re.search(r"unknown variants \['nv rne\|rnee'\]", capsys.readouterr().err)
  script = open(os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_bench.sh")).read()
  default = re.search(r"QUANTIZE_VARIANTS:-([^}]*)\}", script).group(1).split(",")
  assert set(default) <= set(quantize.VARIANTS) and set(quantize.DOC_VARIANTS) <= set(quantize.VARIANTS)
  assert tuple(default) == quantize.DOC_VARIANTS  # the script's default is the list the docs' tables show

def test_step_with_microbatches_leaves_flax_fp8_out_of_its_default_routes(capsys):
  """Flax's FP8 op runs in one pass: with --microbatches the default routes go on without it (said so), where it
  stopped the run with a usage error after the routes before it had run."""
  args = argparse.Namespace(tokens=(4, 16), microbatches=2, routes=list(step.DEFAULT_ROUTES), scan=False,
                            scan_saves="outputs", gemm="auto", top=None, profile=False)
  step._check(args)
  assert args.routes == [r for r in step.DEFAULT_ROUTES if r != "flax_fp8"]
  assert "flax_fp8 left out of the default routes" in capsys.readouterr().out


def test_dot_exits_1_when_a_row_fails(monkeypatch, capsys):
  """A row that fails (a compile error, out of memory) is a FAILED row in the table and exit status 1, so a
  script running the bench notices."""
  def fail(*args, **kwargs):
    raise RuntimeError("no")
  monkeypatch.setattr(timing, "bench", fail)
  monkeypatch.setattr(timing, "copy_bandwidth", lambda size: 1e12)
  assert main(["dot", "--small", "--shapes", "0", "--routes", "bf16", "--iters", "1", "--no-check",
               "--no-gemm-rows"]) == 1
  assert "FAILED" in capsys.readouterr().err


def test_cli_errors():
  with pytest.raises(SystemExit):
    main(["dot", "--no-such-flag"])
  with pytest.raises(SystemExit):
    main(["nope"])



@pytest.mark.parametrize("argv, message", [
    (["triton", "mx nope"], "unknown kernels"),
    (["triton", "--shape", "40x128", "mx rne"], "kernel 'mx rne' does not take --shape 40x128"),
    (["compile", "--step", "tiny", "--triton", "--routes", "mxfp4"], "use --h200 without --xla"),
    (["compile", "--step", "tiny", "--h200", "--xla", "--triton", "--routes", "mxfp4"], "use --h200 without --xla"),
    (["compile", "--step", "tiny", "--xla", "--routes", "mxfp4"], "--xla compiles an --h200 lowering with XLA:GPU"),
    (["compile", "--layers", "2", "--routes", "mxfp4"], "--layers shape a whole step; add --step"),
    (["compile", "--tokens", "2x16", "--scan", "--routes", "mxfp4"], "--tokens, --scan shape a whole step"),
    (["compile", "--step", "tiny", "--small", "--routes", "mxfp4"], "--small and --shapes choose fp4_dot's shapes"),
    (["compile", "--step", "tiny", "--warm", "--routes", "mxfp4"], "--warm keeps the persistent cache on"),
    (["--compile-cache", " ", "program", "--small", "--routes", "mxfp4"], "an empty compilation cache setting"),
    (["--compile-cache", "On", "triton", "mx nope"],  # it made the directory ./On, then refused the kernel
     r"^python -m bench triton: error: --compile-cache='On': 'On' names no compilation cache directory: give 'auto' "
     r"for the default directory, 'off' for none, or a path \(\./On for a directory of that name\)$"),
    (["program", "--small", "--routes", "bf16"], "bf16 lowers no quantizer or FP4 GEMM"),
    (["triton", "--shape", "32x32", "eden amax rht128"], "kernel 'eden amax rht128' does not take --shape 32x32"),
    (["step", "--preset", "tiny", "--scan-saves", "operands", "--routes", "bf16"], "--scan-saves .* add --scan"),
    (["--kernels-first", "on", "dot", "--small", "--routes", "bf16"],
     "--kernels-first is read by bench compile and step .*; bench dot compiles without it: drop it"),
    (["step", "--preset", "tiny", "--top", "5", "--routes", "bf16"],
     "--top sets how many kernels and GEMMs --profile lists; add --profile"),
    (["compile", "--step", "tiny", "--h200", "--hlo", "x", "--routes", "mxfp4"], "--hlo writes compiled programs"),
    (["compile", "--step", "tiny", "--h200", "--passes", "3", "--routes", "mxfp4"], "--h200 only lowers"),
    (["compile", "--small", "--repeat", "2", "--routes", "bf16"], "--repeat times whole steps' first calls"),
    (["compile", "--step", "tiny", "--h200", "--repeat", "2", "--routes", "bf16"], "without --h200"),
    (["compile", "--step", "tiny", "--repeat", "2", "--hlo", "x", "--routes", "bf16"], "--triton or --hlo"),
    (["compile", "--step", "tiny", "--h200", "--kernels", "--routes", "mxfp4"], "--kernels compiles each Pallas"),
    (["compile", "--step", "tiny", "--repeat", "2", "--kernels", "--routes", "bf16"], "without --warm or --repeat"),
    (["dot", "--small", "--shapes", "0", "3", "--routes", "bf16"],
     r"--shapes 3 is no shape; the --small shapes are 0: up"),
    (["diagnose", "--linears", "layers.0.attn.qq", "--routes", "mxfp4"],
     r"--linears: no FP4Linear at \['layers.0.attn.qq'\]"),
    # Options the chosen input does not read, which it ignored
    (["diagnose", "--stress", "--tokens", "2x64", "--linears", "all", "--routes", "mxfp4"],
     r"--tokens, --linears not read with --stress \(they pick a model's linears\); drop them$"),
    (["diagnose", "--run", "runs/x", "--preset", "30m", "--routes", "mxfp4"],
     r"--preset not read with --run \(its model is the run's own\); drop it$"),
    (["diagnose", "--shape", "64", "64", "64", "--routes", "mxfp4"],
     r"--shape not read without --stress \(it is --stress's linear shape\); drop it$"),
    (["step", "--preset", "tiny", "--tokens", "2x16", "--attention", "cudnn", "--routes", "bf16"], "cudnn needs a GPU"),
    (["step", "--preset", "tiny", "--tokens", "2x16", "--attention", "cudnn", "--routes", "bf16", "--out",
      "rows/step.json"], "cudnn needs a GPU"),  # --out's folder is made by the writer, not while parsing
    (["step", "--preset", "tiny", "--tokens", "3x16", "--microbatches", "2", "--routes", "bf16"],
     "batch of 3 sequences does not split into --microbatches 2 equal passes"),
    (["step", "--preset", "tiny", "--tokens", "2x16", "--microbatches", "2", "--routes", "flax_fp8"],
     "flax_fp8 runs in one pass"),
    (["step", "--preset", "tiny", "--tokens", "2x32", "--gemm", "mosaic", "--routes", "bf16", "mxfp4"],
     "--gemm: the mosaic GEMM backend compiles for a Hopper GPU"),  # it failed after bf16's row
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch, cpu_backend):
  """Input mistakes are a one-line error and exit status 2 (1 means a failed check), never a traceback. Off a GPU
  (`cpu_backend`): cuDNN's attention and the mosaic GEMM are mistakes there."""
  monkeypatch.chdir(tmp_path)  # where the output folders some of them name (--hlo x) would go
  assert main(["--compile-cache", "off", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and re.search(message, err), err
  assert not os.listdir(tmp_path)  # a refused command makes no folder (--hlo x made x while parsing)


@pytest.mark.parametrize("dim, hopper", [(528, True), (200, True), (272, False)])
def test_step_cudnn_attention_with_a_head_dim_it_does_not_take_is_one_line(monkeypatch, capsys, dim, hopper):
  """`bench step --attention cudnn` refuses a head dim cuDNN's flash attention does not take (a multiple of 8 up
  to 128, 256 from Hopper on) as train does: its first step failed when traced. Here the backend only says it is
  a GPU of the given kind, and a preset of that head dim (dim // 2 heads) stands in."""
  from fp4jax.nn.llama import config, layers  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(layers.cudnn_attention, "check_compute_capability", lambda capability: hopper)
  monkeypatch.setattr(step.build, "check_impl", lambda *a: None)  # the CPU's kernels, which a GPU's check refuses
  monkeypatch.setitem(config.PRESETS, "wide", dataclasses.replace(config.PRESETS["tiny"], dim=dim, n_heads=2,
                                                                  n_kv_heads=1))
  argv = ["--compile-cache", "off", "step", "--preset", "wide", "--tokens", "2x16", "--attention", "cudnn",
          "--routes", "bf16"]
  assert main(argv) == 2
  assert capsys.readouterr().err.strip() == (
      f"python -m bench step: error: bench step: --attention cudnn takes a head_dim that is a multiple of 8 "
      f"up to {256 if hopper else 128} on this GPU (cuDNN's flash attention), not head_dim={dim // 2} "
      f"(preset wide: dim={dim} // n_heads=2); use --attention auto or xla")


@pytest.mark.parametrize("argv, message", [
    (["step", "--routes", "bf16", "fp3"], "argument --routes: unknown route 'fp3'; routes: bf16, "),
    (["dot", "--routes", "flax_fp8"], "argument --routes: unknown route 'flax_fp8'"),  # a step baseline only
    (["diagnose", "--preset", "7b"], "argument --preset: unknown Llama preset '7b'; presets: tiny, "),
    (["compile", "--step", "30m", "--tokens", "8x0"], "argument --tokens: '8x0' is not BATCHxSEQ"),
    (["step", "--tokens", "8*1024"], "argument --tokens: '8\\*1024' is not BATCHxSEQ"),
    (["quantize", "--shapes", "16384x4096,12y3"], "argument --shapes: '12y3' is not MxK"),
    (["step", "--iters", "0"], "argument --iters: 0 must be >= 1"),
    (["diagnose", "--samples", "two"], "argument --samples: 'two' is not an integer"),
    (["diagnose", "--seed", "-1"], "argument --seed: -1 must be >= 0"),  # NumPy's traceback before
    (["dot", "--seed", "99999999999999999999"], "argument --seed: 99999999999999999999 must be >= 0 and < "),
    (["compile", "--step", "tiny", "--scan", "all"], "argument --scan: takes no value .* or 'auto'"),
    (["step", "--tokens", "4096x65536"], "argument --tokens: 4096x65536: 268,435,456 is more than the 4,194,304"),
    (["triton", "--num-warps", "3"], "argument --num-warps: 3 is not a power of two from 1 to 32"),
    (["dot", "--routes"], "argument --routes: expected at least one argument"),
    # Where results go is checked before any work: a directory in place of a file, a file in place of one.
    (["step", "--out", "{tmp}"], "argument --out: '.*' is a directory; name a file in it"),
    (["dot", "--out", "{tmp}/new/"], "argument --out: '.*new/' is a directory; name a file in it"),
    (["step", "--out", ""], "argument --out: an empty path; name the file to write"),
    (["step", "--out", "{file}/rows.json"], "argument --out: its directory='.*file': cannot use it as a directory"),
    (["compile", "--hlo", "{file}"], "argument --hlo: directory='.*file': cannot use it as a directory"),
    (["step", "--hlo", "{file}/new/hlo"], r"argument --hlo: directory='.*file/new/hlo': cannot use it as a "
                                          r"directory \('.*file' is not a directory\)"),
    (["program", "--dump", "{file}"], "argument --dump: directory='.*file': cannot use it"),
    (["quantize", "--out", "{file}"], "argument --out: directory='.*file': cannot use it"),
])
def test_bad_arguments_are_one_line_usage_errors(argv, message, capsys, tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit) as exit_:
    main([a.format(tmp=tmp_path, file=tmp_path / "file") for a in argv])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and re.search(message, err.splitlines()[-1]), err


def test_triton_lowers_every_kernel():
  """`python -m bench triton`: every listed kernel lowers to Triton IR (compiled by the `triton` package where
  installed), without a GPU."""
  for name, fn in triton.KERNELS.items():
    assert "tt.load" in triton.triton_ir(fn, (256, 256)), name


def test_abstract_h200_lowers_without_sharding_constraints():
  """`bench compile --h200` lowers on the abstract H200's one-device mesh of Auto axes, as train's mesh: an
  Explicit axis had put a sharding constraint after nearly every operation (4k in the 30M bf16 step), which
  inflated the lowering that bench times and that no real run holds."""
  with triton.on_abstract_h200():
    text = jax.jit(lambda x: jnp.tanh(x * 2.0) + 1.0).trace(jnp.ones((8, 128), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.tanh" in text and "sharding_constraint" not in text


def test_ptx_instructions_counts_opcode_lines_only():
  ptx = """.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .b32 	%r<4>;
$L__BB0_1:
	// begin inline asm
	ld.global.b32 { %r1 }, [ %rd1 + 0 ];
	@%p1 st.global.b8 [ %rd2 + 0 ], %r1;
	@!%p2 bra 	$L__BB0_1;
	.loc	1 7 11
	ret;
}"""
  assert triton.ptx_instructions(ptx) == 4  # ld, predicated st, negated-predicate bra, ret


def test_ptx_fingerprint_follows_the_code_not_its_debug_lines():
  code = "\t.reg .b32 \t%r<4>;\n$L__BB0_1:\n\tld.global.b32 { %r1 }, [ %rd1 + 0 ];\n\t@%p1 bra \t$L__BB0_1;\n\tret;\n"
  debug = "\t.file\t1 \"/src/kernel.py\"\n\t.loc\t1 {line} 11\n$L__tmp0:\n\t// comment\n"
  ptx = lambda line, body=code: debug.format(line=line) + body + "\t.section\t.debug_abbrev\n{\n.b8 {line}\n}\n"
  assert triton.ptx_fingerprint(ptx(7)) == triton.ptx_fingerprint(ptx(9))  # a moved source line: same code
  assert triton.ptx_fingerprint(ptx(7)) != triton.ptx_fingerprint(ptx(7, code.replace("b32 {", "b16 {")))
  assert re.fullmatch(r"[0-9a-f]{12}", triton.ptx_fingerprint(ptx(7)))


def test_sass_pipes_counts_opcodes_by_pipe():
  """`bench triton`'s SASS counts: opcodes with their modifiers and predicates, integer-ALU and FMA-pipe ones."""
  sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R51, R73, 0x3f, RZ, 0xc0, !PT ;
        /*0020*/                   IMAD.SHL.U32 R48, R51, 0x20, RZ ;
        /*0030*/              @!P2 FFMA R71, R31, R0, 8388608 ;
        /*0040*/               @P0 SHF.R.U32.HI R24, RZ, 0x16, R31 ;
        /*0050*/                   VIMNMX3.U32 R0, R36, R29, R0, !PT ;
        /*0060*/                   EXIT ;
  """
  assert triton.sass_pipes(sass) == (7, 3, 2)


def test_triton_reports_instructions_and_registers(capsys):
  """`bench triton`: per kernel, the PTX instructions per thread and ptxas's registers (needs the `triton`
  package, not an fp4jax dependency)."""
  pytest.importorskip("triton")
  main(["triton", "--shape", "256x256", "mx rne"])
  out = capsys.readouterr().out
  instructions, sass, alu, fma, registers = re.search(
      r"(\d+) instructions  SASS (\d+) \(ALU (\d+), FMA (\d+)\) .* registers (\d+) \(spills \d+ B\)  PTX code "
      r"[0-9a-f]{12}", out).groups()
  assert int(instructions) > 100 and 0 < int(registers) <= 255, out
  assert 0 < int(alu) + int(fma) < int(sass), out


def test_ptxas_usage_with_a_later_triton(monkeypatch):
  """`triton` after 3.5.1 (a PyTorch install's) takes the target in `get_ptxas(arch)`: `bench triton` called
  `get_ptxas()` and failed with a TypeError on such a GPU host. Both versions name ptxas in `triton.knobs`."""
  compiler = pytest.importorskip("triton.backends.nvidia.compiler")
  monkeypatch.setattr(compiler, "get_ptxas", lambda arch: compiler.knobs.nvidia.ptxas)  # the later signature
  ptx = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k(.param .u64 p) {\n .reg .b64 %rd<2>;\n" \
        " ld.param.u64 %rd1, [p];\n ret;\n}\n"
  registers, spills = triton.ptxas_usage(ptx)
  assert registers > 0 and spills == 0


def test_program_lowers_for_an_h200_without_one(capsys):
  """`python -m bench program`: the H200 program of fp4_dot (Pallas kernels, FP8 GEMMs writing bf16) from a
  CPU-only machine; its fingerprint ignores SSA names and locations, and is the same on every lowering."""
  hlo, kernels = program.lowered("mxfp4", 128, 256, 512)  # --small's shape 0
  assert len(kernels) == 3 and all("tt.load" in k for k in kernels)  # X, W and dY: one dual-view pass each
  assert "xla.gpu.triton" in hlo and "f8E4M3FN" in hlo and "-> tensor<128x512xbf16>" in hlo
  assert "%v" in hlo and "loc(" not in hlo
  assert program.normalized('%a = f(%b) loc("x.py":1)\n#loc1 = loc("y")') == "%v = f(%v) "
  main(["program", "--small", "--shapes", "0", "--routes", "bf16", "mxfp4"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 and "mxfp4" in lines[0], lines
  digests = lines[0].split("hlo")[1].split()
  assert digests == [program.digest(hlo), "kernels", *map(program.digest, kernels)]


def test_bench_turns_on_the_compilation_cache_and_xla_flags(tmp_path, monkeypatch, capsys):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  main(["--compile-cache", str(tmp_path / "c"), "compile", "--small", "--shapes", "0", "--routes", "bf16"])
  assert os.environ["XLA_FLAGS"] == " ".join(platform.DEFAULT_XLA_FLAGS)
  assert jax.config.jax_compilation_cache_dir is None  # `compile` measures cold compiles unless --warm
  main(["--compile-cache", str(tmp_path / "c"), "compile", "--warm", "--small", "--shapes", "0", "--routes", "bf16"])
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c") and any((tmp_path / "c").iterdir())
  capsys.readouterr()


@pytest.mark.skipif(_CUDA_PLUGIN, reason=_LOWERS_CUDNN)
def test_bench_compile_step_phases_for_an_h200(capsys):
  """`bench compile --step`: a Llama train step's trace / lower phases for an abstract H200, with its Pallas
  kernels counted (one copy of each distinct kernel in the module, however many layers call it)."""
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--tokens", "2x32", "--h200", "--routes", "bf16",
        "mxfp4"])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  tiny unrolled 2x32")]
  assert len(lines) == 2 and "compile    n/a s" in lines[0], lines
  counts = [re.search(r"(\d+) sites / (\d+) distinct", l).groups() for l in lines]
  # X and dY: one dual-view kernel per distinct shape; W (32x32 tiles, one view read by fprop and dgrad) runs as
  # W^T along K: q|k|v's and gate|up's weights (64 x 128, 64 x 384) differ only in the row-tile count their
  # one-axis launches decode (`common.grid_ids`; their grids, which XLA's compile keys hold, differed anyway):
  # 9 sites, 9 distinct.
  assert counts[0] == ("0", "0") and counts[1] == ("9", "9"), counts
  calls = [f'backend_config = {{grid_x = {g} : i32, ir = "{ir}", num_warps = 4 : i32}}'
           for ir, g in (("a", 1), ("b", 1), ("a", 1), ("a", 2))]
  assert compile_bench.kernel_counts(" ".join(calls)) == (4, 2, 3)  # "a" launched on two grids
  # --unfused-linears: one product per linear, so a larger program (q, k, v and gate, up separately).
  hlo = lambda line: float(re.search(r"hlo ([\d.]+)k", line).group(1))
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--tokens", "2x32", "--h200", "--unfused-linears",
        "--routes", "mxfp4"])
  unfused = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  tiny unrolled unfused 2x32")]
  assert len(unfused) == 1 and hlo(unfused[0]) > hlo(lines[1]), (unfused, lines)
  # Scanned blocks lower too (the abstract H200's mesh has explicit axes, which the scan's stacks must carry).
  # `--layers` keeps the preset's shapes with fewer layers (as in `bench step`).
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--layers", "3", "--tokens", "2x32", "--h200",
        "--scan", "--routes", "mxfp4"])
  scanned = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  tiny 3l scanned 2x32")]
  assert len(scanned) == 1 and "compile    n/a s" in scanned[0], scanned


def test_bench_compile_repeat_runs_fresh_processes_and_reports_medians(tmp_path, capsys):
  """`bench compile --step --repeat N`: N rounds of one fresh process per route, a line per measurement, each
  route's median and range, the medians' ratio to bf16's, and every measurement in --out."""
  out = tmp_path / "repeat.json"
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--tokens", "2x32", "--scan", "auto", "--repeat", "2",
        "--routes", "bf16", "mxfp4", "--out", str(out)])
  printed = capsys.readouterr().out
  rows = json.loads(out.read_text())["rows"]
  assert [(r["round"], r["route"]) for r in rows] == [(1, "bf16"), (1, "mxfp4"), (2, "bf16"), (2, "mxfp4")]
  assert [r["name"] for r in rows[:2]] == ["tiny unrolled 2x32 bf16", "tiny scanned 2x32 mxfp4"]  # --scan auto
  medians = {}
  for route in ("bf16", "mxfp4"):
    seconds = [r["first_call"] for r in rows if r["route"] == route]
    assert all(s > 0 for s in seconds)
    medians[route] = (seconds[0] + seconds[1]) / 2
    assert re.search(rf"{route} +first call median +{medians[route]:.1f} s +\(range {min(seconds):.1f}-"
                     rf"{max(seconds):.1f} s over 2 processes\)", printed), printed
  assert f"median first call x bf16's: mxfp4 {medians['mxfp4'] / medians['bf16']:.2f}" in printed, printed


def test_bench_compile_repeat_starts_no_backend_in_the_parent():
  """`--repeat` leaves JAX's backends to its children: on a GPU the parent's client would preallocate most of the
  device's memory while they compile."""
  code = ("from bench.__main__ import main; from jax._src import xla_bridge; "
          "main(['--compile-cache', 'off', 'compile', '--step', 'tiny', '--tokens', '2x32', '--repeat', '2', "
          "'--routes', 'bf16']); print('backends', sorted(xla_bridge._backends))")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).resolve().parents[2])
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines()[-1] == "backends []", done.stdout
  assert f"device: {{'device': '{dot.device_info()['device']}'" in done.stdout, done.stdout  # the children's


@pytest.mark.skipif(_CUDA_PLUGIN, reason="JAX's CUDA plugin is installed")
def test_bench_compile_xla_without_the_cuda_plugin_says_what_to_install(capsys):
  assert main(["--compile-cache", "off", "compile", "--step", "tiny", "--h200", "--xla", "--routes", "bf16"]) == 2
  assert "needs JAX's CUDA plugin (pip install \"jax[cuda13]==0.11.2\"; no GPU needed)" in capsys.readouterr().err


@pytest.mark.skipif(not _CUDA_PLUGIN, reason="needs JAX's CUDA plugin (no GPU)")
def test_bench_compile_xla_compiles_for_an_h200_without_one(tmp_path):
  """`--h200 --xla`: each step compiled by XLA:GPU for the H200 target (Pallas kernels included), every phase
  timed, on a machine with or without a GPU. In a fresh process: the plugin registers when JAX starts its
  backends, which this one did already."""
  out = tmp_path / "rows.json"
  done = subprocess.run([sys.executable, "-m", "bench", "--compile-cache", "off", "compile", "--step", "tiny",
                         "--tokens", "2x32", "--scan", "auto", "--h200", "--xla", "--routes", "bf16", "mxfp4",
                         "--out", str(out)], capture_output=True, text=True, check=True)
  assert "H200 target, compiled by XLA:GPU" in done.stdout
  written = json.loads(out.read_text())
  assert written["info"]["target"] == "H200, deviceless XLA:GPU compile"
  rows = written["rows"]
  assert [r["route"] for r in rows] == ["bf16", "mxfp4"]
  assert all(r["compile"] > 0 and r["first_call"] >= r["compile"] for r in rows)
  assert rows[0]["sites"] == 0 < rows[1]["sites"]


@pytest.mark.skipif(_CUDA_PLUGIN, reason=_LOWERS_CUDNN)
def test_bench_compile_triton_compiles_each_distinct_kernel(capsys):
  """`bench compile --h200 --triton`: every distinct kernel of the step compiled for sm_90 (needs the `triton`
  package, not an fp4jax dependency)."""
  pytest.importorskip("triton")
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--tokens", "2x32", "--h200", "--triton",
        "--routes", "mxfp4"])
  out = capsys.readouterr().out
  n, total = re.search(r"triton \(sm_90, `triton` package\): (\d+) kernels ([\d.]+) s", out).groups()
  assert n == "9" and float(total) > 0, out  # the 9 distinct kernels of test_bench_compile_step_phases_for_an_h200
  per_name = re.findall(r"^        (fp4jax_\w+): (\d+) distinct, ([\d.]+) s", out, re.M)  # one line per kernel name
  assert per_name and sum(int(k) for _, k, _ in per_name) == 9, out
  assert abs(sum(float(s) for _, _, s in per_name) - float(total)) < 0.1 * len(per_name), out


_MODULE = """HloModule jit_train_step
ENTRY %main {
  %fp8 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,32]{1,0} %a, f8e4m3fn[8,32]{1,0} %b), custom_call_target="__cublas$lt$matmul$f8"
  %gemm.2 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%c, %d), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %tg = bf16[8,8]{1,0} fusion(%c, %d), kind=kCustom, calls=%f, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %fmha = (bf16[1,8,2,64]{3,2,1,0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
  %pallas_call.3 = (u8[8,16]{1,0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %all-reduce.1 = f32[8]{0} all-reduce(%g), replica_groups={}, to_apply=%add
  loop_fusion.4 = bf16[8]{0} fusion(%x), kind=kLoop, calls=%f2, metadata={op_name="jit(train_step)/jvp(Llama)/jit(_forward)/mul"}
  %loop_fusion.5 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f3, metadata={op_name="jit(train_step)/adamw/mul"}
  %concatenate_fusion.7 = bf16[8,16]{1,0} fusion(%y, %dh), kind=kInput, calls=%f5, metadata={op_name="jit(train_step)/transpose(jvp(Llama))/jit(_backward)/transpose(jvp(fp4jax_producer))/concatenate"}
  %dynamic-update-slice.9 = bf16[4,8,8]{2,1,0} dynamic-update-slice(%stack, %fp8, %i, %z, %z), metadata={op_name="jit(train_step)/jvp()/while/body/dynamic_update_slice"}
  ROOT %loop_fusion.6 = bf16[8]{0} fusion(%x), kind=kLoop, calls=%f4, metadata={op_name="jit(train_step)/transpose(jvp(Llama))/add"}
}"""


def test_breakdown_categorizes_by_instruction_then_kernel_name():
  kinds = breakdown.categorize(_MODULE)
  assert kinds == {"fp8": "fp8 gemm", "gemm.2": "bf16 gemm", "tg": "bf16 gemm", "fmha": "attention",
                   "pallas_call.3": "quantizers", "all-reduce.1": "communication", "loop_fusion.4": "fp4 glue",
                   "loop_fusion.5": "optimizer", "loop_fusion.6": "elementwise",
                   "concatenate_fusion.7": "elementwise",  # SwiGLU's derivative, computed inside fp4_dot
                   "dynamic-update-slice.9": "elementwise"}
  events = [("fp8", "nvjet_qqtst", 2.0), ("%gemm.2", "sm90_xmma_gemm_bf16", 1.0), ("loop_fusion.5", "k", 0.5),
            ("other.1", "sm90_xmma_gemm_e4m3e4m3", 0.25), ("other.2", "mystery_kernel", 0.125),
            ("loop_fusion.4", "MemcpyD2D", 0.03125), ("dynamic-update-slice.9", "MemcpyD2D", 0.046875),
            ("%dynamic-update-slice.9 = bf16[4,8,8]", "MemcpyD2D", 0.046875)]
  seconds, top = breakdown.breakdown(breakdown.attribute(_MODULE, events))
  assert seconds["fp8 gemm"] == 2.25 and seconds["bf16 gemm"] == 1.0 and seconds["optimizer"] == 0.5
  assert seconds["copies"] == 0.125 and seconds["fp4 glue"] == 0.0
  assert seconds["unattributed"] == 0.125 and top == [("other.2", "mystery_kernel", 0.125)]
  assert set(seconds) == {*breakdown.CATEGORIES, "unattributed"}
  events += [("fp8", "nvjet_qqtst", 1.0)]  # a second launch of the same kernel adds to its total
  assert breakdown.top_kernels(breakdown.attribute(_MODULE, events), n=2) == [("fp8 gemm", "nvjet_qqtst", 3.0),
                                                         ("bf16 gemm", "sm90_xmma_gemm_bf16", 1.0)]
  assert breakdown.top_copies(breakdown.attribute(_MODULE, events), _MODULE) == [  # a copy's launches add up
      ("dynamic-update-slice.9", "bf16[4,8,8]{2,1,0} dynamic-update-slice(%stack, %fp8, %i, %z, %z)",
       "jit(train_step)/jvp()/while/body/dynamic_update_slice", 0.09375),
      ("loop_fusion.4", "bf16[8]{0} fusion(%x), kind=kLoop, calls=%f2",
       "jit(train_step)/jvp(Llama)/jit(_forward)/mul", 0.03125)]
  signatures = breakdown.gemm_signatures(_MODULE)
  assert signatures == {"fp8": "bf16[8,8]{1,0}", "gemm.2": "bf16[8,8]{1,0} (contracting 1/0)"}
  assert breakdown.top_gemms(breakdown.attribute(_MODULE, events), signatures) == [
      ("fp8 gemm", "bf16[8,8]{1,0}", "nvjet_qqtst", 3.0),
      ("bf16 gemm", "bf16[8,8]{1,0} (contracting 1/0)", "sm90_xmma_gemm_bf16", 1.0),
      ("fp8 gemm", "other.1", "sm90_xmma_gemm_e4m3e4m3", 0.25)]


def test_breakdown_counts_a_produced_x_as_the_models_elementwise_work():
  """fp4_dot of `Produced("swiglu", (y,))` computes SwiGLU (where no kernel does) and its derivative inside its
  own passes: those ops are the model's elementwise work, as in a bf16 step, not FP4 glue."""
  from fp4jax import fp4_dot  # pylint: disable=g-import-not-at-top
  from fp4jax.numerics.produced import Produced  # pylint: disable=g-import-not-at-top
  y, w = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  loss = lambda y, w: fp4_dot(Produced("swiglu", (y,)), w, route="mxfp4", key=jax.random.key(0)).sum(
      dtype=jnp.float32)
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(y, w).compile().as_text()
  producer = breakdown.categorize("\n".join(line for line in text.splitlines() if "fp4jax_producer" in line))
  assert producer and set(producer.values()) == {"elementwise"}
  assert "fp4 glue" in breakdown.categorize(text).values()  # fp4_dot's own glue stays glue


def test_against_bf16_is_the_step_with_bf16s_time_for_all_but_the_gemms():
  """The H100's Llama-1B profile of 2026-12-06 (docs/BENCHMARKS.md), ms: with bf16's 218.8 - 138.2 ms besides
  its GEMMs and mxfp4's 59.4 + 12.6 ms of GEMMs, mxfp4 could take 152.6 ms, 1.434x bf16's step; its 208.5 ms
  are 55.9 over that: quantizers 30.0, glue 20.7, copies 14.6 - 1.4, and -8.0 ms of the rest."""
  cats = lambda **ms: {c: ms.get(c.replace(" ", "_"), 0.0) / 1e3 for c in (*breakdown.CATEGORIES, "unattributed")}
  bf16 = cats(bf16_gemm=138.2, attention=29.7, elementwise=30.2, optimizer=10.3, copies=1.4)
  mxfp4 = cats(fp8_gemm=59.4, bf16_gemm=12.6, quantizers=30.0, attention=26.5, fp4_glue=20.7, elementwise=31.2,
               optimizer=10.3, copies=14.6)
  a = breakdown.against_bf16(mxfp4, 0.2085, bf16, 0.2188)
  assert a["bound_s"] == pytest.approx(0.1526) and a["bound_x"] == pytest.approx(1.4338, abs=1e-4)
  assert a["overhead_s"] == pytest.approx(0.0559)
  parts = {k: round(v * 1e3, 6) for k, v in a["overhead_parts_s"].items()}
  assert parts == {"quantizers": 30.0, "fp4 glue": 20.7, "copies": 13.2, "rest": -8.0}
  # Timed and profiled in separate runs: on a loaded machine bf16's profiled GEMMs can exceed its timed step, and
  # the bound would be meaningless (it printed -1.42x in a CI run): none then.
  assert breakdown.against_bf16(mxfp4, 0.2085, bf16, 0.0700) is None


def test_step_flops_per_token_is_6n_plus_attention():
  from fp4jax.nn.llama import LlamaConfig  # pylint: disable=g-import-not-at-top
  cfg = LlamaConfig.preset("1b", max_seq_len=2048)
  d, f, kv = 2048, 8192, 8 * 64
  per_layer = 2 * d * d + 2 * d * kv + 3 * d * f  # q, o; k, v; gate, up, down
  n = 16 * per_layer + d * cfg.vocab_size  # blocks + lm_head (the embedding lookup is no matmul)
  assert step.flops_per_token(cfg, 2048) == 6 * n + 6 * 16 * 2048 * d


def test_bench_step_runs_and_profiles(tmp_path, capsys):
  out = tmp_path / "step.json"
  main(["--compile-cache", "off", "step", "--preset", "tiny", "--tokens", "2x32", "--routes", "bf16", "mxfp4",
        "--iters", "1", "--profile", "--top", "3", "--out", str(out), "--hlo", str(tmp_path / "hlo")])
  rows = json.loads(out.read_text())["rows"]
  assert [r["route"] for r in rows] == ["bf16", "mxfp4"]
  peak = step.PEAK_BF16_FLOPS.get(jax.devices()[0].device_kind)  # None: no MFU (a CPU, an unlisted GPU)
  for r in rows:
    assert r["tokens_per_s"] > 0 and r["compile_s"] > 0 and r["memory_bytes"] > 0
    assert r["mfu"] is None if peak is None else 0 < r["mfu"] < 1
    assert sum(r["breakdown_s"].values()) > 0
    assert 0 < len(r["top_kernels"]) <= 3 and len(r["top_gemms"]) <= 3 and len(r["top_copies"]) <= 3
    assert sum(s for _, _, s in r["top_kernels"]) <= sum(r["breakdown_s"].values()) + 1e-9
  assert rows[0]["breakdown_s"]["fp4 glue"] == 0 < rows[1]["breakdown_s"]["fp4 glue"]
  bound = rows[1]["against_bf16"]  # None where this machine's load made the profile and the timing disagree
  assert "against_bf16" not in rows[0] and (bound is None or bound["bound_x"] > 0)
  hlo = sorted(p.name for p in (tmp_path / "hlo").iterdir())
  assert hlo == ["tiny_2l_2x32_unrolled_bf16.hlo.txt", "tiny_2l_2x32_unrolled_mxfp4.hlo.txt"]
  assert "ENTRY" in (tmp_path / "hlo" / hlo[1]).read_text()
  printed = capsys.readouterr().out
  assert "x bf16" in printed and "ms per step" in printed and "top kernels, mxfp4" in printed
  line = "mxfp4: no bound against bf16: " if bound is None else "mxfp4: with bf16's time for all but its GEMMs"
  assert line in printed


def test_scan_auto_runs_each_route_as_training_does(tmp_path, capsys):
  """`--scan auto`: a quantized route's blocks scanned, bf16's unrolled (training's `model.scan_layers: auto`),
  in `bench step` (each row says how) and `bench compile` (which ends with each first call against bf16's)."""
  out = tmp_path / "step.json"
  main(["--compile-cache", "off", "step", "--preset", "tiny", "--tokens", "2x32", "--scan", "auto", "--routes",
        "bf16", "mxfp4", "--iters", "1", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["route"], r["scan"], r["scan_saves"]) for r in rows] == [("bf16", False, None),
                                                                      ("mxfp4", True, "outputs")]
  printed = capsys.readouterr().out
  assert "for quantized routes, unrolled for bf16" in printed
  assert re.search(r"^bf16 \(unrolled\) ", printed, re.M) and re.search(r"^mxfp4 \(scanned\) ", printed, re.M)
  main(["--compile-cache", "off", "compile", "--step", "tiny", "--tokens", "2x32", "--scan", "auto", "--routes",
        "bf16", "mxfp4", "--out", str(out), "--hlo", str(tmp_path / "hlo")])
  lines = capsys.readouterr().out.splitlines()
  hlo = sorted(p.name for p in (tmp_path / "hlo").iterdir())  # --hlo: each compiled program
  assert hlo == ["tiny_scanned_2x32_mxfp4.hlo.txt", "tiny_unrolled_2x32_bf16.hlo.txt"], hlo
  assert "is_scheduled=true" in (tmp_path / "hlo" / hlo[0]).read_text()
  assert [l.split()[1] for l in lines if l.startswith("  tiny ")] == ["unrolled", "scanned"]
  # The printed lines round each first call to 0.1 s; the ratio is taken from the unrounded times (the JSON rows).
  firsts = {r["route"]: r["first_call"] for r in json.loads(out.read_text())["rows"]}
  ratio = re.search(r"first call x bf16's: mxfp4 ([\d.]+)$", lines[-1]).group(1)
  assert ratio == f"{firsts['mxfp4'] / firsts['bf16']:.2f}", (lines[-1], firsts)
  decided = lambda scan, route: step.llama_step("tiny", route, batch=2, seq=32, scan=scan).scanned
  assert decided(True, "bf16") and not decided(False, "mxfp4")
  assert decided("auto", "fp8") and not decided("auto", "flax_fp8")


def test_bench_step_microbatches(tmp_path):
  """`--microbatches 2` runs the step in two passes (train's data.microbatches): the row says so, and the
  updated parameters equal one pass's up to float32 summation order (a dropped pass would change them)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = tmp_path / "step.json"
  main(["--compile-cache", "off", "step", "--preset", "tiny", "--tokens", "4x32", "--routes", "mxfp4", "--iters",
        "1", "--microbatches", "2", "--out", str(out)])
  (row,) = json.loads(out.read_text())["rows"]
  assert row["microbatches"] == 2 and row["tokens_per_s"] > 0
  params = []
  for microbatches in (1, 2):
    step_fn, create, _, _, cfg, _ = step.llama_step("tiny", "bf16", batch=4, seq=32, microbatches=microbatches)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size, jnp.int32)
    state, _ = jax.jit(step_fn)(create(), tokens, jnp.int32(0))
    params.append(np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree.leaves(state[0])]))
  # Each pass's bf16 weight gradient is rounded before the two are summed, so the gradients differ in bf16's
  # last bits. The first AdamW update (lr 1e-4) is lr * g / |g|: equal unless a near-zero g flips its sign
  # (0.3% of the elements here), and then at most 2 lr apart. Half the batch's gradient would flip far more.
  close = np.isclose(params[1], params[0], rtol=1e-4, atol=1e-6)
  assert close.mean() > 0.99 and np.abs(params[1] - params[0]).max() <= 2.5e-4, (close.mean(),)


def test_flax_fp8_baseline_keeps_delayed_scaling_state(tmp_path):
  # Flax's FP8 op in the step: its scales and amax histories are written back each step (not optimized), the
  # parameters are trained, and the second step scales x by the first step's amax / 448 (E4M3's max).
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  step_fn, create, _, tokens_spec, cfg, _ = step.llama_step("tiny", flax_fp8.NAME, batch=2, seq=32)
  assert not cfg.fuse_linears
  state = create()
  tokens = jax.random.randint(jax.random.key(1), tokens_spec.shape, 0, cfg.vocab_size)
  jitted = jax.jit(step_fn)
  states = [state]
  for i in range(2):
    state, loss = jitted(state, tokens, i)
    states.append(state)
    assert np.isfinite(float(loss))
  flat = [dict(nnx.to_flat_state(s[0])) for s in states]
  q = ("layers", 0, "attn", "q")
  value = lambda k, name: np.asarray(flat[k][(*q, name)][...])
  assert type(flat[0][(*q, "input_scale")]).__name__ == "Fp8Meta"
  assert value(0, "input_amax_history").max() == 0 < value(1, "input_amax_history")[0]
  np.testing.assert_allclose(value(2, "input_scale"), value(1, "input_amax_history").max() / 448.0, rtol=1e-6)
  assert not np.array_equal(value(0, "kernel"), value(2, "kernel"))
  # The optimizer state holds Params only: the FP8 state is no optimizer's business.
  assert not any("amax" in str(path) for path, _ in nnx.to_flat_state(state[1]))
  out = tmp_path / "step.json"
  main(["--compile-cache", "off", "step", "--preset", "tiny", "--tokens", "2x32", "--routes", "bf16",
        flax_fp8.NAME, "--iters", "1", "--scan", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["route"], r["fused_linears"]) for r in rows] == [("bf16", True), (flax_fp8.NAME, False)]
  assert rows[1]["tokens_per_s"] > 0


@pytest.mark.gpu
def test_gpu_flax_fp8_step_runs_cublaslt_fp8_gemms():
  # The flax_fp8 row times FP8 GEMMs only if XLA rewrites Flax's float8 dots (written to bf16) to cuBLASLt's:
  # three per block linear (forward, dgrad, wgrad) in an unrolled step.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  step_fn, _, abstract, tokens_spec, cfg, _ = step.llama_step("tiny", flax_fp8.NAME, batch=4, seq=64)
  hlo = jax.jit(step_fn).lower(abstract, tokens_spec, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
  assert dot.gemm_targets(hlo).count("__cublas$lt$matmul$f8") == 3 * 7 * cfg.n_layers, dot.gemm_targets(hlo)


def test_flax_fp8_convert_refuses_fused_or_quantized_linears():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.nn import RouteRules  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama import Llama, LlamaConfig  # pylint: disable=g-import-not-at-top
  tiny = LlamaConfig.preset("tiny")
  for fuse, route, match in ((True, "bf16", "needs unfused linears"), (False, "mxfp4", "replaces bf16 products")):
    model = Llama(dataclasses.replace(tiny, fuse_linears=fuse), rngs=nnx.Rngs(0),
                  rules=RouteRules.standard(route, n_layers=tiny.n_layers, bf16_first=0, bf16_last=0))
    with pytest.raises(ValueError, match=match):
      flax_fp8.convert(model)


def test_bench_step_scanned_with_a_save_policy(tmp_path, capsys):
  out = tmp_path / "step.json"
  main(["--compile-cache", "off", "step", "--preset", "tiny", "--tokens", "2x32", "--routes", "bf16", "--iters",
        "1", "--scan", "--scan-saves", "operands", "--out", str(out)])
  (row,) = json.loads(out.read_text())["rows"]
  assert row["scan"] is True and row["scan_saves"] == "operands" and row["tokens_per_s"] > 0
  assert "scanned (saving operands)" in capsys.readouterr().out


def test_inlined_size_counts_each_call_site():
  text = """HloModule m
f.1 {
  p = f32[] parameter(0)
  a = f32[] add(p, p)
  ROOT b = f32[] multiply(a, a)
}
ENTRY main.2 {
  x = f32[] parameter(0)
  s = f32[] custom-call(x), custom_call_target="Sharding", sharding={replicated}
  c1 = f32[] call(s), to_apply=f.1
  c2 = f32[] call(c1), to_apply=f.1
  ROOT r = f32[] conditional(pred, c1, c2), branch_computations={%f.1, %f.1}
}"""
  assert compile_bench.inlined_size(text) == 3 + 4 * 2  # 3 own (no parameter, no Sharding) + 4 inlined bodies


@pytest.mark.gpu
def test_gpu_scanned_step_runs_each_forward_gemm_once():
  """The forward loop of a scanned step holds at most one GEMM per linear (7 per block; XLA may merge q, k, v),
  none inside a dynamic-slice fusion: that fusion cloned each GEMM whose output is also a saved residual (o,
  gate, up) on the H200 until the apps turned it off (`platform.DEFAULT_XLA_FLAGS`)."""
  fn, _, state, tokens, _, _ = step.llama_step("tiny", "bf16", batch=2, seq=64, scan=True, layers=3)
  text = jax.jit(fn).lower(state, tokens, jax.ShapeDtypeStruct((), jax.numpy.int32)).compile().as_text()
  gemms = [line for line in text.splitlines() if 'custom_call_target="__cublas' in line]
  forward = [line for line in gemms if re.search(r'op_name="[^"]*jvp\(\)/while/body', line)
             and "transpose(" not in line]
  assert 0 < len(forward) <= 7, len(forward)
  fusions = re.findall(r"^%dynamic-slice-fusion[^{]*\{(.*?)^\}", text, flags=re.S | re.M)
  assert not any("__cublas" in body for body in fusions)


def test_bench_diagnose_takes_sequences_past_the_presets_length(capsys):
  """--tokens' SEQ sets the model's max_seq_len (the tiny preset's own is 128), as `bench step` does."""
  assert main(["--compile-cache", "off", "diagnose", "--tokens", "1x256", "--linears", "layers.0.mlp.down",
               "--routes", "bf16", "--samples", "1"]) == 0
  assert "on 1x256 random tokens" in capsys.readouterr().out


def test_kernels_first_flag_sets_threads_and_keeps_kernels_beside_a_cache(capsys):
  """`--kernels-first on|off|N` and `--compile-cache` as `fp4jax.compiling.KernelsFirst`'s keywords: kernel files
  beside a cache that is on, in a temporary directory otherwise; a bad value is one usage line."""
  from bench import args as args_lib  # pylint: disable=g-import-not-at-top
  ns = lambda kf, cache: argparse.Namespace(kernels_first=kf, compile_cache=cache)
  assert args_lib.kernels_first(ns("off", "off")) == {"threads": 0, "directory": None}
  assert args_lib.kernels_first(ns("6", "/tmp/c")) == {"threads": 6, "directory": pathlib.Path("/tmp/c-xla-kernels")}
  assert args_lib.kernels_first(ns("on", "/tmp/c"), cache=False) == {"threads": None, "directory": None}
  assert args_lib.kernels_first(ns(None, "off")) == {"threads": None, "directory": None}  # not given: on
  with pytest.raises(SystemExit):
    main(["--kernels-first", "fast", "compile", "--small"])
  assert "--kernels-first takes on, off or a thread count, got 'fast'" in capsys.readouterr().err
