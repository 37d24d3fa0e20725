"""`python -m train`: a user's mistake is one line on stderr and exit status 2, checked before any data work."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import cpu_devices
from fp4jax import Impl
from train import build, config, data, errors
from train.main import EXIT_USER_ERROR, main


@pytest.fixture(name="no_data_work")
def _no_data_work(monkeypatch):
  """Fails the test if a run gets as far as tokenizing: every config check must come first."""
  def forbidden(*args, **kwargs):
    raise AssertionError("load_splits called before the config was fully checked")
  monkeypatch.setattr(data, "load_splits", forbidden)


def _error_line(capsys, argv: list[str]) -> str:
  assert main(argv) == EXIT_USER_ERROR
  lines = capsys.readouterr().err.strip().splitlines()  # progress lines may come before the error
  assert not any("Traceback" in l for l in lines), lines
  assert [l for l in lines if "error" in l] == lines[-1:] and lines[-1].startswith("python -m train: error: ")
  return lines[-1]


def _args(tmp_path, *sets: str) -> list[str]:
  out = ["--config", "configs/cpu_compare.yaml", "--set", f"run.out_dir={tmp_path / 'run'}"]
  for s in sets:
    out += ["--set", s]
  return out


@pytest.mark.parametrize("sets, match", [
    (["route=nvfp5", "run.routes=[]"], "route='nvfp5' is not a route; routes: ['bf16', 'mxfp4'"),
    (["run.routes=[bf16, mxfp5]"], "run.routes[1]='mxfp5' is not a route"),
    (["optim.lr=-1e-3"], "optim.lr=-0.001 must be a finite number > 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be a finite number >= 0"),
    (["optim.b2=1.5"], "optim.b2=1.5 must be in [0, 1)"),
    (["data.eval_fraction=0"], "data.eval_fraction=0.0 must be in (0, 1)"),
    (["model.overrides.dimm=64"], "unknown key(s) ['model.overrides.dimm']; valid keys in model.overrides: "
                                  "['vocab_size', 'dim', "),
    (["model.preset=tiniest"], "model.preset='tiniest' must be one of ['tiny',"),
    (["model.dtype=fp16"], "model.dtype='fp16' must be one of ['bfloat16', 'float32']"),
    (["optim.schedule=linear"], "optim.schedule='linear' must be one of ['cosine', 'wsd']"),
    (["data.sources=[/nonexistent/*.txt]"], "data.sources: '/nonexistent/*.txt' matches no files"),
    (["run.mesh=[3, 1]"], "run.mesh=[3, 1] does not cover the 1 device(s)"),
    (["kernels.quantizer=pallas"], "kernels: Impl(quantizer='pallas') compiles the Pallas kernels for a GPU, but "
                                   "JAX's default backend is not one"),
    (["optim.lrr=1"], "unknown key(s) ['optim.lrr']"),
    (["rules.extra=[layer\\.0\\..*=bf16]"], "rules.extra: route rules 'layer\\.0\\..*=bf16' decide the route of no "
                                          "linear"),
    (["rules.extra=[' =bf16']"], "rules.extra: route rule ' =bf16' must read 'REGEX=ROUTE'"),
    (["run.routes=[bf16, fp8, mxfp4]", "kernels.gemm=native"],  # was a traceback when fp8 compiled, mxfp4 unrun
     "kernels: GEMM backend 'native' does not support a.fmt='fp8_e4m3'"),
    (["run.routes=[bf16]", "rules.extra=[layers\\.0\\..*=fp8]", "kernels.gemm=native"],  # a rule's route too
     "kernels: GEMM backend 'native' does not support a.fmt='fp8_e4m3'"),
    (["route=mxfp4", "run.routes=[]", "kernels.gemm=mosaic"], "kernels: the mosaic GEMM backend compiles for a "
                                                                "Hopper GPU"),
    (["model.overrides.attention_impl=cudnn"], "model.overrides.attention_impl='cudnn' needs a GPU (this "
                                               "backend: cpu)"),  # a traceback at the first step
])
def test_config_mistakes_are_one_line_before_any_data_work(tmp_path, capsys, no_data_work, sets, match, cpu_backend):
  """Off a GPU (`cpu_backend`) the Pallas kernels, the mosaic GEMM and cuDNN's attention are mistakes too."""
  assert match in _error_line(capsys, _args(tmp_path, *sets))


def test_cudnn_attention_in_float32_is_a_mistake_on_a_gpu(tmp_path, capsys, no_data_work, monkeypatch):
  """cuDNN's flash attention takes bf16/fp16 only: model.dtype=float32 with attention_impl=cudnn failed when the
  first step traced, after tokenizing; in bfloat16 the check passes (here the backend only says it is a GPU)."""
  monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(build, "check_kernels", lambda *a: None)  # the CPU's kernels, which a GPU's check refuses
  assert _error_line(capsys, _args(tmp_path, "model.overrides.attention_impl=cudnn", "model.dtype=float32")) == (
      "python -m train: error: model.overrides.attention_impl='cudnn' takes bfloat16 only (cuDNN's flash "
      "attention), not model.dtype='float32'; set model.dtype=bfloat16, or attention_impl 'auto' or 'xla' (XLA's "
      "attention in float32)")
  lcfg = build.llama_config(config.load_config(None, ["model.overrides.attention_impl=cudnn"]), 257)
  build.check_attention(lcfg, "bfloat16")


@pytest.mark.parametrize("dim, n_heads, hopper, refused", [
    (48, 4, True, True), (272, 2, False, True), (272, 2, True, False), (528, 2, True, True), (512, 2, True, False),
    (256, 2, False, False),
])
def test_cudnn_attention_with_a_head_dim_it_does_not_take_is_a_mistake(monkeypatch, dim, n_heads, hopper, refused):
  """cuDNN's flash attention takes a head_dim that is a multiple of 8 up to 128 (256 from Hopper on): another one
  failed when the first step traced, after tokenizing (here the backend only says it is a GPU, of the given kind)."""
  from jax._src.cudnn import fused_attention_stablehlo
  monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: hopper)
  sets = ["model.overrides.attention_impl=cudnn", f"model.overrides.dim={dim}", f"model.overrides.n_heads={n_heads}",
          "model.overrides.n_kv_heads=1"]
  lcfg = build.llama_config(config.load_config(None, sets), 257)
  if not refused:
    build.check_attention(lcfg, "bfloat16")
    return
  with pytest.raises(errors.UserError) as e:
    build.check_attention(lcfg, "bfloat16")
  assert str(e.value) == (
      f"model.overrides.attention_impl='cudnn' takes a head_dim that is a multiple of 8 up to "
      f"{256 if hopper else 128} on this GPU (cuDNN's flash attention), not head_dim={dim // n_heads} "
      f"(dim={dim} // n_heads={n_heads}); change model.overrides dim or n_heads, or set attention_impl 'auto' or "
      f"'xla' (XLA's attention)")


@pytest.mark.parametrize("hopper", [False, True])
def test_cudnn_attention_check_agrees_with_auto(monkeypatch, hopper):
  """train's check of attention_impl=cudnn accepts exactly the head dims for which attention_impl=auto takes
  cuDNN's attention (auto sent 136..256 to XLA's attention on Hopper, where the check let cudnn take them). Here
  the backend only says it is a GPU of the given kind, and a recorder stands in for cuDNN's call."""
  import jax.numpy as jnp
  from jax._src.cudnn import fused_attention_stablehlo
  from fp4jax.nn.llama import layers
  monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: hopper)
  monkeypatch.setattr(layers, "_cudnn_attention", lambda q, k, v, layer: q.at[0, 0, 0, 0].set(1))
  for dim in (248, 256, 264, 272, 504, 512, 520, 528):
    sets = ["model.overrides.attention_impl=cudnn", f"model.overrides.dim={dim}", "model.overrides.n_heads=2",
            "model.overrides.n_kv_heads=1"]
    lcfg = build.llama_config(config.load_config(None, sets), 257)
    try:
      build.check_attention(lcfg, "bfloat16")
      accepted = True
    except errors.UserError:
      accepted = False
    q = jnp.zeros((1, 4, 2, lcfg.head_dim), jnp.bfloat16)
    auto_takes_cudnn = bool(layers.attention(q, q[:, :, :1], q[:, :, :1], "auto")[0, 0, 0, 0] == 1)
    assert accepted == auto_takes_cudnn, (lcfg.head_dim, accepted)


def test_a_tokenizer_path_the_byte_tokenizer_ignores_is_one_warning(tmp_path, capsys, monkeypatch):
  """data.tokenizer_path with data.tokenizer=byte (`--set data.tokenizer=byte` over a GPT-2 config) was ignored
  silently: one warning line at the checks before the data, only where both are set."""
  def stop(*args, **kwargs):
    raise errors.UserError("stopped at the data")

  monkeypatch.setattr(data, "load_splits", stop)
  for sets, warned in ((["data.tokenizer_path=~/gpt2"], True), ([], False)):
    assert main(_args(tmp_path, *sets)) == EXIT_USER_ERROR
    lines = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert lines == ([f"[train] warning: data.tokenizer_path={os.path.expanduser('~/gpt2')!r} is ignored: "
                      f"data.tokenizer=byte reads no files"] if warned else [])


def test_kernel_check_passes_the_mosaic_gemm_for_an_h200():
  """The check traces fp4_dot at sizes every GEMM backend tiles: the mosaic backend's CTA tiles need a side of
  256, and the check's 128-wide product refused `kernels.gemm: mosaic` on the GPUs it is for."""
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with use_abstract_mesh(mesh):
    build.check_impl(Impl(gemm="mosaic"), ["mxfp4", "bf16"], "kernels")


def test_config_file_mistakes(tmp_path, capsys):
  assert "cannot read config file 'nope.yaml': No such file or directory" in _error_line(
      capsys, ["--config", "nope.yaml"])
  bad = tmp_path / "bad.yaml"
  bad.write_text("model: {preset: tiny\nroute: bf16\n")
  assert f"{bad}:2:6: malformed YAML (expected ',' or '}}', but got ':'); fix that line" in _error_line(
      capsys, ["--config", str(bad)])
  twice = tmp_path / "twice.yaml"  # PyYAML keeps the last of two keys: the first run: section's steps were lost
  twice.write_text(f"run:\n  steps: 7\nmodel: {{preset: tiny}}\nrun:\n  out_dir: {tmp_path / 'run'}\n")
  assert f"{twice}:4:1: malformed YAML (key 'run' given twice, first on line 1); fix that line" in _error_line(
      capsys, ["--config", str(twice)])
  merged = tmp_path / "merged.yaml"  # a merge key's keys may be given again: that is what it is for
  merged.write_text("base: &b {steps: 3, seed: 1}\nrun:\n  <<: *b\n  steps: 5\n")
  assert config.read_yaml(str(merged))["run"] == {"steps": 5, "seed": 1}


def test_data_mistakes(tmp_path, capsys):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  assert f"data.sources: {empty} is empty; fill it or remove it from data.sources" in _error_line(
      capsys, _args(tmp_path, f"data.sources=[{empty}]"))
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def f(x):\n  return x\n" * 200)
  line = _error_line(capsys, _args(tmp_path, f"data.sources=[{corpus}]", f"data.cache_dir={tmp_path / 'c'}",
                                   "data.seq_len=100000", "data.workers=1"))
  assert "100000, fewer than data.batch_size=8; lower them or add data" in line


def test_a_held_out_file_that_is_trained_on_is_refused_before_any_data_work(tmp_path, capsys, no_data_work):
  # An eval_sources file that data.sources also matched was trained on and evaluated as held-out text, silently.
  for name in ("a.txt", "b.txt"):
    (tmp_path / name).write_text("some text\n")
  line = _error_line(capsys, _args(tmp_path, f"data.sources=[{tmp_path}/*.txt]",
                                   f"data.eval_sources=[{tmp_path / 'b.txt'}]"))
  assert (f"data.eval_sources: {tmp_path / 'b.txt'} is also matched by data.sources, so the evaluation would not be "
          f"on held-out text; remove it from one of the two") in line


def test_a_binary_source_is_refused_before_any_data_work(tmp_path, capsys, no_data_work):
  # Token ids given as a text source were decoded with replacement characters and trained on.
  ids = tmp_path / "train.bin"
  ids.write_bytes(bytes(range(256)) * 4)
  line = _error_line(capsys, _args(tmp_path, f"data.sources=[{ids}]"))
  assert f"data source {ids} is not UTF-8 text (byte 0: b'\\x00'), a binary file? Sources are text" in line


@pytest.mark.parametrize("routes", ["[]", "[bf16]"])
def test_a_file_where_checkpoints_go_is_refused_at_once(tmp_path, capsys, routes):
  """A file named ckpt in the run's directory (out_dir/<route>/ckpt in compare mode): one line before any work,
  where Orbax failed at the first save with a long traceback, after the steps before it had trained."""
  out = tmp_path / "run" / ("bf16" if routes != "[]" else "")
  out.mkdir(parents=True, exist_ok=True)
  (out / "ckpt").write_text("x")
  line = _error_line(capsys, _args(tmp_path, f"run.routes={routes}", *(["route=bf16"] if routes == "[]" else [])))
  assert f"{str(out / 'ckpt')!r} is not a directory, where the run keeps its checkpoints" in line


def test_debug_shows_the_traceback(tmp_path, capsys):
  assert main(["--debug", *_args(tmp_path, "optim.lr=-1")]) == EXIT_USER_ERROR
  err = capsys.readouterr().err
  assert "Traceback" in err and err.strip().splitlines()[-1] == (
      "python -m train: error: optim.lr=-1.0 must be a finite number > 0")


_MESH_CHECK = textwrap.dedent("""
  import contextlib, io, json, sys
  from train import data
  from train.main import main
  def tokenizing(*args, **kwargs):
    raise SystemExit(42)  # the preflight passed: stop before any data work
  data.load_splits = tokenizing
  out = {}
  for mesh in ("[1, 3]", "[3, 1]"):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      try:
        rc = main(["--config", "configs/cpu_compare.yaml", "--set", f"run.out_dir={sys.argv[1]}", "--set",
                   f"run.mesh={mesh}", "--set", "data.batch_size=6", "--set", "run.compile_cache=none"])
      except SystemExit as e:
        rc = e.code
    out[mesh] = [rc, err.getvalue()]
  json.dump(out, sys.stdout)
""")


def test_mesh_axis_that_does_not_divide_a_parameter_is_a_config_mistake(tmp_path):
  """On 3 devices, fsdp=3 cannot split the dim-128 model's matrices: that is refused before tokenizing, naming the
  parameter and a mesh that fits; data=3 splits only the batch and passes. (Before, jax's IndivisibleError came
  from the initializer, after the data was tokenized.) A subprocess, since the device count is fixed at start."""
  out = json.loads(cpu_devices.run(_MESH_CHECK, 3, str(tmp_path / "run"), timeout=240).stdout)
  rc, err = out["[1, 3]"]
  assert rc == EXIT_USER_ERROR and "Traceback" not in err, err
  assert err.strip().splitlines()[-1] == (
      "python -m train: error: model parameter layers.0.attn.k.kernel: dimension 0 (size 128) is sharded over mesh "
      "axis 'fsdp' of size 3 (run.mesh=[1, 3]), which does not divide it; use run.mesh=[3, 1], or model.overrides "
      "whose sharded sizes are multiples of 3"), err
  assert out["[3, 1]"][0] == 42, out["[3, 1]"][1]
