"""Config: YAML + dotted overrides, type conversion, unknown keys listing the valid ones."""

import glob
import os

import jax
import pytest

from train import config


def _write(tmp_path, text):
  p = tmp_path / "c.yaml"
  p.write_text(text)
  return str(p)


def test_yaml_and_overrides(tmp_path):
  path = _write(tmp_path, "model: {preset: 30m, overrides: {n_layers: 2}}\nroute: mxfp4\n"
                          "data: {seq_len: 64, sources: [a.txt, 'b/*.xz']}\nrun: {routes: [bf16, nvfp4]}\n")
  cfg = config.load_config(path, ["optim.lr=1e-3", "run.mesh=[2,4]", "data.batch_size=32",
                                  "model.overrides.dim=384", "run.resume=false", "rules.extra=[lm_head=bf16]"])
  assert cfg.model.preset == "30m" and cfg.model.overrides == {"n_layers": 2, "dim": 384}
  assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads "1e-3" as a string
  assert cfg.route == "mxfp4"
  assert cfg.data.sources == ("a.txt", "b/*.xz") and cfg.data.seq_len == 64 and cfg.data.batch_size == 32
  assert cfg.run.routes == ("bf16", "nvfp4") and cfg.run.mesh == (2, 4) and cfg.run.resume is False
  assert cfg.rules.extra == ("lm_head=bf16",)
  assert cfg.optim.b2 == config.OptimConfig().b2  # untouched defaults stay


@pytest.mark.parametrize("override, match", [
    ("optim.lrr=1", r"unknown key\(s\) \['optim.lrr'\].*'lr'"),
    ("nope=1", r"unknown key\(s\) \['nope'\].*'optim'"),
    ("data.seq_len=abc", r"data.seq_len: expected an int, got 'abc'"),
    ("data.seq_len=1.5", r"data.seq_len: expected an int"),
    ("run.resume=3", r"run.resume: expected true/false"),
    ("optim=3", r"optim: expected a mapping"),
    ("optim.lr=[1]", r"optim.lr: expected a number"),
    ("noequals", r"must look like key.sub=value"),
    ("run.log_every=0", r"run.log_every=0 must be >= 1"),  # was a ZeroDivisionError after the first step
    ("run.steps=0", r"run.steps=0 must be >= 1"),
    ("run.compile_cache=on", r"run.compile_cache='on': 'on' names no compilation cache directory: give 'auto' "
                             r"for the default directory, 'off' for none, or a path \(\./on for a directory of "
                             r"that name\)$"),
    ("run.compile_cache=Yes", r"run.compile_cache='Yes': 'Yes' names no compilation cache directory: .*\./Yes"),
    ("run.seed=1e400", r"run.seed: expected an int, got '1e400'"),  # was an OverflowError traceback
    ("run.steps=.inf", r"run.steps: expected an int, got inf"),
    ("run.routes=[bf16,mxfp4,bf16]", r"run.routes=\['bf16', 'mxfp4', 'bf16'\] names a route twice"),
    ("study.tokens=1", r"unknown key\(s\) \['study'\].*python -m train.study"),
    ("run.seed=9223372036854775808", r"run.seed: 9223372036854775808 is too large \(\|value\| < 2\*\*63\)"),
    ("run.compile_cache=", r"run.compile_cache='': an empty compilation cache setting: give 'auto', 'off' or a "),
    ("run.ckpt_every=-1", r"run.ckpt_every=-1 must be >= 0"),
    ("data.batch_size=0", r"data.batch_size=0 must be >= 1"),
    ("data.microbatches=0", r"data.microbatches=0 must be >= 1"),
    ("data.microbatches=3", r"data.batch_size=16 must be a multiple of data.microbatches=3 \(equal microbatches\)"),
    ("model.scan_saves=all", r"model.scan_saves='all' must be one of \['outputs', 'operands'\]"),
    ("model.scan_layers=sometimes", r"model.scan_layers='sometimes' must be one of \[True, False, 'auto'\]"),
    ("optim.warmup=-5", r"optim.warmup=-5 must be >= 0"),
    ("rules.bf16_last=3", r"rules.bf16_first=0 \+ rules.bf16_last=3 blocks in bf16 is more than the model's 2 blocks"),
])
def test_errors(override, match):
  with pytest.raises(config.ConfigError, match=match):
    config.load_config(None, [override])


@pytest.mark.parametrize("text, match", [
    ("run: {compile_cache: on}", r"run.compile_cache: expected a string, got True \(YAML reads"),
    ("run: {out_dir: 2026-12-06}", r"run.out_dir: expected a string, got datetime.date\(2026, 12, 6\) \(YAML reads a "
                                   r"date such as 2026-12-06 unquoted as a date: quote the value\)"),
    ("run: {out_dir: ~}", r"run.out_dir: expected a string, got None \(YAML reads ~ and null unquoted as no value"),
    ("data: {sources: [runs, 2026-12-06]}", r"data.sources\[1\]: expected a string, got datetime.date\(2026, 12, 6\) "
                                            r"\(YAML reads a date"),
])
def test_file_values_yaml_misreads_are_named(tmp_path, text, match):
  """In a config file a string key's value is YAML's: a word YAML reads as something else is refused by name."""
  with pytest.raises(config.ConfigError, match=match):
    config.load_config(_write(tmp_path, text))


def test_set_keeps_the_text_of_string_keys():
  """`--set` gives a key declared `str` its text as typed (YAML made run.out_dir=1.10 the folder 1.1, 0x10 16 and
  2026-12-06 a date); a quoted one loses its quotes; other keys' values are still YAML (numbers, lists, bools,
  null)."""
  sets = ["run.out_dir=1.10", "data.cache_dir=0x10", "data.tokenizer_path=2026-12-06", "run.compile_cache= null ",
          "model.dtype='float32'", "route=\"bf16\"", "optim.lr=1e-3", "run.mesh=[1, -1]", "run.resume=no",
          "data.sources=[a.txt, b.txt]", "model.overrides.attention_impl=null", "data.seq_len=0x10"]
  cfg = config.load_config(None, sets)
  assert (cfg.run.out_dir, cfg.data.cache_dir, cfg.data.tokenizer_path) == ("1.10", "0x10", "2026-12-06")
  assert cfg.run.compile_cache == "null" and cfg.model.dtype == "float32" and cfg.route == "bf16"
  assert cfg.optim.lr == 1e-3 and cfg.run.mesh == (1, -1) and cfg.run.resume is False and cfg.data.seq_len == 16
  assert cfg.data.sources == ("a.txt", "b.txt") and cfg.model.overrides["attention_impl"] is None
  assert config.load_config(None, ["run.out_dir=~"]).run.out_dir == os.path.expanduser("~")


def test_set_keeps_the_text_of_string_list_items():
  """`--set` gives each item of a key declared a list of strings its text as typed (YAML made
  data.sources=[1.10] the file 1.1 and run.routes=[1.10] a number); quotes still group, a malformed list is still
  named, and a list of ints is still read as numbers."""
  cfg = config.load_config(None, ["data.sources=[a, 1.10, 0x10, 'b c']", "data.eval_sources=2026-12-06",
                                  "rules.extra=[blocks.0.*=bf16]", "run.mesh=[1, -1]"])
  assert cfg.data.sources == ("a", "1.10", "0x10", "b c") and cfg.data.eval_sources == ("2026-12-06",)
  assert cfg.rules.extra == ("blocks.0.*=bf16",) and cfg.run.mesh == (1, -1)
  with pytest.raises(config.ConfigError, match=r"run.routes\[0\]='1.10' is not a route"):
    config.load_config(None, ["run.routes=[1.10]"])
  with pytest.raises(config.ConfigError, match=r"data.sources\[0\]: expected a string, got \['a'\]"):
    config.load_config(None, ["data.sources=[[a]]"])
  with pytest.raises(config.ConfigError, match=r"the value is not valid YAML"):
    config.load_config(None, ["data.sources=[a, b"])


def test_shipped_configs_resolve():
  """Every configs/*.yaml loads (a study config: every run's config), and its model preset and route rules resolve
  (no model is built)."""
  from train import build, objective, study
  paths = sorted(glob.glob("configs/*.yaml"))
  assert "configs/cpu_compare.yaml" in paths and "configs/study_30m.yaml" in paths
  vocab = {"byte": 257, "gpt2": 50257, "sentencepiece": 32000}
  for p in paths:
    cfgs = [r.cfg for r in study.load(p).runs] if "study" in config.read_yaml(p) else [config.load_config(p)]
    for cfg in cfgs:
      lcfg = build.llama_config(cfg, vocab[cfg.data.tokenizer])
      assert lcfg.vocab_size % 128 == 0 and lcfg.max_seq_len >= cfg.data.seq_len, p
      for route in cfg.run.routes or (cfg.route,):
        build.route_rules(config.replace(cfg, route=route), lcfg.n_layers)
      assert objective.lr_schedule(cfg.optim, cfg.run.steps)(cfg.run.steps) > 0, p


def test_kernels_section_reaches_every_linear():
  """`kernels:` becomes the model's Impl, held by every FP4Linear (no global switch)."""
  from fp4jax import Impl
  from fp4jax.nn import FP4Linear
  from flax import nnx
  from train import build, train
  cfg = config.load_config(None, ["kernels.quantizer=xla", "kernels.gemm=emulated", "route=mxfp4"])
  assert cfg.kernels.impl() == Impl(quantizer="xla", gemm="emulated")
  ts = train.init_train_state(cfg, 256, build.make_mesh((1, 1), jax.devices()[:1]))
  model, _ = nnx.merge(ts.graphdef, ts.state)
  impls = {m.impl for _, m in nnx.iter_graph(model) if isinstance(m, FP4Linear)}
  assert impls == {Impl(quantizer="xla", gemm="emulated")}
  with pytest.raises(config.ConfigError, match="kernels.quantizer='cuda' must be one of"):
    config.load_config(None, ["kernels.quantizer=cuda"])
  with pytest.raises(config.ConfigError, match="kernels.gemm='cublas' must be one of"):
    config.load_config(None, ["kernels.gemm=cublas"])


@pytest.mark.parametrize("override, match", [  # each was a crash inside JAX, a NaN loss or a model with no blocks
    ("dim=32.5", r"model.overrides.dim: expected an int, got 32.5"),
    ("dim=abc", r"model.overrides.dim: expected an int, got 'abc'"),  # was "not all arguments converted ..."
    ("n_layers=true", r"model.overrides.n_layers: expected an int, got True"),
    ("n_layers=0", r"model.overrides.n_layers=0 must be >= 1"),
    ("n_heads=0", r"model.overrides.n_heads=0 must be >= 1"),  # was a ZeroDivisionError
    ("n_kv_heads=0", r"model.overrides.n_kv_heads=0 must be >= 1"),
    ("ffn_dim=-5", r"model.overrides.ffn_dim=-5 must be >= 1"),
    ("vocab_size=0", r"model.overrides.vocab_size=0 must be >= 1"),
    ("max_seq_len=0", r"model.overrides.max_seq_len=0 must be >= 1"),
    ("rope_theta=-1", r"model.overrides.rope_theta=-1.0 must be a finite number > 0"),
    ("rope_theta=.nan", r"model.overrides.rope_theta=nan must be a finite number > 0"),
    ("norm_eps=-1", r"model.overrides.norm_eps=-1.0 must be a finite number > 0"),
    ("init_std=0", r"model.overrides.init_std=0.0 must be a finite number > 0"),
    ("rope_theta=[1]", r"model.overrides.rope_theta: expected a number, got \[1\]"),
    ("tie_embeddings=3", r"model.overrides.tie_embeddings: expected true/false, got 3"),
    ("rope_scaling=3", r"model.overrides.rope_scaling: expected a mapping, got 3"),
    ("rope_scaling={factor: -2}", r"model.overrides.rope_scaling.factor=-2.0 must be a finite number > 0"),
    ("rope_scaling={original_max_position: 0}", r"model.overrides.rope_scaling.original_max_position=0 must be >= 1"),
    ("rope_scaling={low_freq_factor: 5}", r"model.overrides.rope_scaling=\{'low_freq_factor': 5\}: .*must exceed"),
    ("rope_scaling={factr: 2}", r"unknown key\(s\) \['model.overrides.rope_scaling.factr'\].*'factor'"),
    ("attention_impl=flash",  # was "model.overrides={...the whole dict...}: unknown self.attention_impl='flash'"
     r"^model.overrides.attention_impl='flash' must be one of \['auto', 'xla', 'cudnn', None\]$"),
])
def test_model_override_errors(override, match):
  test_errors("model.overrides." + override, match)


def test_model_overrides_take_the_llama_config_types():
  """Overrides become the LlamaConfig field types (an integral 32.0 the int 32, as for every int key; a mapping a
  Llama3RopeScaling), so the model gets the values it expects and config.yaml stores plain ones."""
  from fp4jax.nn.llama import LlamaConfig
  from fp4jax.nn.llama.config import Llama3RopeScaling
  sets = ["dim=32.0", "n_heads=2.0", "norm_eps=1", "rope_scaling={factor: 4}", "attention_impl=null"]
  cfg = config.load_config(None, ["model.overrides." + s for s in sets])
  o = cfg.model.overrides
  assert o["dim"] == 32 and type(o["dim"]) is int and type(o["n_heads"]) is int and type(o["norm_eps"]) is float
  assert o["rope_scaling"] == Llama3RopeScaling(factor=4.0) and o["attention_impl"] is None
  assert LlamaConfig.preset(cfg.model.preset, **o).head_dim == 16
  assert config.to_dict(cfg)["model"]["overrides"]["rope_scaling"]["factor"] == 4.0
  assert config.replace(cfg, model={"scan_layers": False}).model.overrides == o  # checked again, unchanged


def test_large_ints_are_taken_exactly():
  """An int past float's 2^53 is not "expected an int" (it was compared with its float, which rounds it)."""
  assert config.load_config(None, [f"run.seed={2**53 + 1}"]).run.seed == 2**53 + 1
  assert config.load_config(None, [f"run.seed='{2**62 + 1}'"]).run.seed == 2**62 + 1
  with pytest.raises(config.ConfigError, match=r"run.seed=9223372036854775807 must be >= 0 and < 2\*\*63 - 1"):
    config.load_config(None, [f"run.seed={2**63 - 1}"])  # JAX cannot make a key of run.seed + 1


def test_documented_words_and_home_paths_are_read_as_meant():
  """`run.compile_cache=off` as documented (YAML reads it as false); a leading ~ in a path expanded as a shell
  would (no shell expands it after `=`: it made a directory named "~")."""
  cfg = config.load_config(None, ["run.compile_cache=off", "run.out_dir=~/runs/x", "data.cache_dir=~/tok",
                                   "data.tokenizer_path=~/gpt2"])
  assert cfg.run.compile_cache == "off"
  assert cfg.run.out_dir == os.path.expanduser("~/runs/x") and cfg.data.cache_dir == os.path.expanduser("~/tok")
  assert cfg.data.tokenizer_path == os.path.expanduser("~/gpt2")


def test_kernels_split_tokens_names_the_token_axes():
  assert config.load_config(None).kernels.impl().token_axes == "auto"
  assert config.load_config(None, ["kernels.split_tokens=false"]).kernels.impl().token_axes == ()


def test_route_override_in_compare_mode_is_an_error():
  """--set route=X with a config that runs run.routes would train those routes and ignore X silently."""
  with pytest.raises(config.ConfigError, match=r"--set route=... is not read in compare mode.*run.routes=\[nvfp4\]"):
    config.load_config("configs/cpu_compare.yaml", ["route=nvfp4"])
  assert config.load_config("configs/cpu_compare.yaml", ["run.routes=[nvfp4]"]).run.routes == ("nvfp4",)


def test_a_config_file_that_is_not_text_is_one_line(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_bytes(b"\xff\xfe\x00model: x")
  with pytest.raises(config.ConfigError, match="not UTF-8 text"):
    config.load_config(str(path))


def test_model_override_mistake_is_one_cli_line(tmp_path, capsys, monkeypatch):
  """`python -m train --set model.overrides.rope_theta=-1` is one line and exit status 2 before any data work (it
  used to tokenize, then train to a NaN loss)."""
  from train import data
  from train.main import EXIT_USER_ERROR, main
  monkeypatch.setattr(data, "load_splits", lambda *a, **k: pytest.fail("tokenized before the config was checked"))
  argv = ["--config", "configs/cpu_compare.yaml", "--set", f"run.out_dir={tmp_path / 'run'}", "--set",
          "model.overrides.rope_theta=-1"]
  assert main(argv) == EXIT_USER_ERROR
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      "python -m train: error: model.overrides.rope_theta=-1.0 must be a finite number > 0")


def test_a_setting_added_since_a_run_was_saved_counts_as_its_default():
  """Runs saved before data.microbatches existed trained in one pass: their records and checkpoints still match a
  config at the default, and differ from one that asks for more passes."""
  now = config.to_dict(config.Config())
  saved = config.to_dict(config.Config())
  del saved["data"]["microbatches"]
  assert config.changed_settings(saved, now) == []
  more = config.to_dict(config.replace(config.Config(), data={"batch_size": 16, "microbatches": 2}))
  assert config.changed_settings(saved, more) == ["data.microbatches: 1 -> 2"]


def test_unusable_directories_are_one_cli_line(tmp_path, capsys, monkeypatch):
  """A run or cache directory that cannot be made or written (a file in its place, a missing parent under a
  file) is one line and exit status 2 before any work, not an OSError traceback."""
  from train.main import EXIT_USER_ERROR, main
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  for key in ("run.out_dir", "data.cache_dir", "run.compile_cache"):
    for path in (blocker, blocker / "sub"):
      argv = ["--set", f"run.out_dir={tmp_path / 'run'}", "--set", f"{key}={path}"]
      assert main(argv) == EXIT_USER_ERROR, (key, path)
      err = capsys.readouterr().err.strip().splitlines()
      assert err[-1].startswith(f"python -m train: error: {key}={str(path)!r}: cannot use it as a directory"), err
  monkeypatch.setenv("FP4JAX_CACHE", str(blocker))  # the directory of run.compile_cache=auto, which names no path
  assert main(["--set", f"run.out_dir={tmp_path / 'run'}", "--set", "run.compile_cache=auto"]) == EXIT_USER_ERROR
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("python -m train: error: run.compile_cache=auto, whose directory ($FP4JAX_CACHE, else "
                            f"$XDG_CACHE_HOME/fp4jax/jax)={str(blocker)!r}: cannot use it as a directory"), err


def test_a_yes_for_the_compile_cache_is_one_cli_line(tmp_path, capsys, monkeypatch):
  """run.compile_cache " On " (quoted in a config file, so neither YAML nor the config's own check read it as a
  word) made a directory " On " in the working directory; it is one line and exit status 2, and nothing is
  made."""
  from train.main import EXIT_USER_ERROR, main
  monkeypatch.chdir(tmp_path)
  path = _write(tmp_path, 'run: {compile_cache: " On "}\ndata: {sources: [missing.txt]}\n')
  assert main(["--config", path, "--set", f"run.out_dir={tmp_path / 'run'}"]) == EXIT_USER_ERROR
  err = capsys.readouterr().err.strip()
  assert err == ("python -m train: error: run.compile_cache=' On ': 'On' names no compilation cache directory: give "
                 "'auto' for the default directory, 'off' for none, or a path (./On for a directory of that "
                 "name)"), err
  assert sorted(os.listdir(tmp_path)) == ["c.yaml"]


def test_a_file_in_place_of_a_routes_directory_is_one_cli_line(tmp_path, capsys):
  """Compare mode's out_dir/<route> is checked as out_dir is (a FileExistsError traceback after the first
  routes had trained, before)."""
  from train.main import EXIT_USER_ERROR, main
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "mxfp4").write_text("")
  assert main(["--set", f"run.out_dir={tmp_path / 'run'}", "--set", "run.routes=[bf16, mxfp4]"]) == EXIT_USER_ERROR
  err = capsys.readouterr().err.strip().splitlines()
  route_dir = str(tmp_path / "run" / "mxfp4")
  assert err[-1].startswith(f"python -m train: error: run.out_dir of route mxfp4={route_dir!r}: cannot use it as a "
                            f"directory"), err
