"""Training configuration: nested frozen dataclasses loaded from YAML plus dotted `--set` overrides.

`load_config("configs/x.yaml", ["optim.lr=1e-3", "route=nvfp4"])` reads the file, applies each override to the
nested dict, then builds the dataclasses, checking every key and converting every value to the field's type.
Unknown keys fail with the list of valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import types
import typing
from typing import Any

import yaml

from train.errors import ConfigError
from train.yaml_files import read_yaml


_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
# Documented string values that YAML 1.1 reads as booleans unquoted (`--set run.compile_cache=off`).
_WORDS_READ_AS_BOOL = {("run.compile_cache", False): "off"}
_POSITIVE = (lambda v: 0 < v < math.inf, "a finite number > 0")
_NON_NEGATIVE = (lambda v: 0 <= v < math.inf, "a finite number >= 0")
_FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
_OPEN_FRACTION = (lambda v: 0 < v < 1, "in (0, 1)")
_BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
_SEED = (lambda v: 0 <= v < 2**63 - 1, ">= 0 and < 2**63 - 1 (run.seed + 1 seeds the held-out loss's key)")
DTYPES = ("bfloat16", "float32")
SCHEDULES = ("cosine", "wsd")
TOKENIZERS = ("byte", "gpt2", "sentencepiece")


def _one_of(choices: typing.Sequence[str]) -> tuple[Any, str]:
  return (lambda v: v in choices, f"one of {list(choices)}")


def expand_home(cfg: Any, field: str) -> None:
  """A leading ~ of a path field of a frozen config expanded, as a shell would: `--set run.out_dir=~/runs`
  reaches us unexpanded (no shell expands ~ after =), and would make a directory named "~"."""
  value = getattr(cfg, field)
  if isinstance(value, str) and value.startswith("~"):
    object.__setattr__(cfg, field, os.path.expanduser(value))


def _check_counts(section: str, cfg: Any, rules: dict[str, tuple[Any, str]]) -> None:
  """Fails on the first field of `cfg` outside its range, naming it and its value (before any data work)."""
  for name, (ok, need) in rules.items():
    value = getattr(cfg, name)
    if not ok(value):
      raise ConfigError(f"{section}.{name}={value!r} must be {need}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A `LlamaConfig.preset(preset, **overrides)`; vocab_size comes from the tokenizer unless overridden.

  dtype is the activation/compute dtype of the non-FP4 parts ("bfloat16" on accelerators; "float32" is ~3x
  faster on CPU, where XLA emulates bf16 dots). scan_layers: compile each run of same-route blocks once
  (`Llama(scan_layers=...)`): faster compiles of deep models, slower bf16 steps (same numbers); "auto" (the
  default) scans the blocks of a quantized route and unrolls a bf16 model. scan_saves: what a
  scanned block keeps for its backward, a key of `fp4jax.nn.llama.model.SCAN_POLICIES` ("outputs", "operands").
  """
  preset: str = "tiny"
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  dtype: str = "bfloat16"
  scan_layers: bool | str = "auto"
  scan_saves: str = "outputs"

  def __post_init__(self):
    from fp4jax.nn.llama import PRESETS, LlamaConfig  # pylint: disable=g-import-not-at-top
    from fp4jax.nn.llama.config import FieldError  # pylint: disable=g-import-not-at-top
    from fp4jax.nn.llama.model import SCAN_POLICIES  # pylint: disable=g-import-not-at-top
    _check_counts("model", self, {"preset": _one_of(list(PRESETS)), "dtype": _one_of(DTYPES),
                                  "scan_layers": _one_of([True, False, "auto"]),
                                  "scan_saves": _one_of(list(SCAN_POLICIES))})
    valid = [f.name for f in dataclasses.fields(LlamaConfig)]
    unknown = sorted(set(self.overrides) - set(valid))
    if unknown:
      raise ConfigError(f"unknown key(s) {['model.overrides.' + k for k in unknown]}; valid keys in "
                        f"model.overrides: {valid}")
    object.__setattr__(self, "overrides", _model_overrides(self.overrides, LlamaConfig))
    try:  # the model's own checks (n_layers >= 1, dim a multiple of n_heads, ...) now rather than after tokenizing
      LlamaConfig.preset(self.preset, **self.overrides)
    except FieldError as e:  # a value out of its range, named by its key
      raise ConfigError(e.named(f"model.overrides.{e.field}")) from e
    except (TypeError, ValueError) as e:
      raise ConfigError(f"model.overrides={self.overrides}: {e}") from e


def _model_overrides(overrides: dict[str, Any], llama_config: type) -> dict[str, Any]:
  """`overrides` converted to the types of the LlamaConfig fields they name, so that dim=32.0 is 32 and dim=32.5
  fails here in one line; the ranges (n_layers=0, norm_eps=-1) are LlamaConfig's and Llama3RopeScaling's own
  checks, named here by the key that set the value."""
  from fp4jax.nn.llama.config import FieldError  # pylint: disable=g-import-not-at-top
  hints = typing.get_type_hints(llama_config)
  try:
    return {k: convert(v, hints[k], f"model.overrides.{k}") for k, v in overrides.items()}
  except ConfigError:
    raise
  except FieldError as e:  # a rope_scaling value out of its range
    raise ConfigError(e.named(f"model.overrides.rope_scaling.{e.field}")) from e
  except ValueError as e:  # Llama3RopeScaling's own check: high_freq_factor > low_freq_factor
    raise ConfigError(f"model.overrides.rope_scaling={overrides.get('rope_scaling')!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class RulesConfig:
  """Per-layer route rules: keep the first/last blocks in bf16; `extra` are 'regex=route' rules tried first."""
  bf16_first: int = 0
  bf16_last: int = 0
  extra: tuple[str, ...] = ()

  def __post_init__(self):
    from fp4jax.nn import RouteRules  # pylint: disable=g-import-not-at-top
    _check_counts("rules", self, {"bf16_first": _AT_LEAST_0, "bf16_last": _AT_LEAST_0})
    try:
      RouteRules.parse(list(self.extra))  # checks each rule's form and route name
    except (TypeError, ValueError) as e:
      raise ConfigError(f"rules.extra: {e}") from e


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Text sources (paths/globs, or "stdlib"; a file that several match is read once), tokenizer, window shape and
  the held-out split."""
  sources: tuple[str, ...] = ("stdlib",)
  tokenizer: str = "byte"  # byte | gpt2 | sentencepiece
  tokenizer_path: str = ""  # gpt2: directory with encoder.json + vocab.bpe; sentencepiece: the .model file
  seq_len: int = 128
  batch_size: int = 16  # sequences per optimizer step
  # Sequential passes per step: the batch is split into this many equal microbatches whose gradients are
  # averaged (the whole batch's update, up to float32 summation order), so only one microbatch's activations
  # are alive at a time. 1: the whole batch in one pass.
  microbatches: int = 1
  eval_fraction: float = 0.01  # last fraction of documents held out (ignored when eval_sources is set)
  eval_sources: tuple[str, ...] = ()
  cache_dir: str = ".cache/fp4jax-tokens"
  workers: int = 0  # tokenizer processes; 0 = os.cpu_count()

  def __post_init__(self):
    expand_home(self, "cache_dir")
    expand_home(self, "tokenizer_path")
    _check_counts("data", self, {"seq_len": _AT_LEAST_1, "batch_size": _AT_LEAST_1, "workers": _AT_LEAST_0,
                                 "microbatches": _AT_LEAST_1, "eval_fraction": _OPEN_FRACTION,
                                 "tokenizer": _one_of(TOKENIZERS)})
    if self.batch_size % self.microbatches:
      raise ConfigError(f"data.batch_size={self.batch_size} must be a multiple of data.microbatches="
                        f"{self.microbatches} (equal microbatches)")
    if not self.sources:
      raise ConfigError("data.sources is empty: name at least one file, glob or 'stdlib'")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup then cosine or warmup-stable-decay (wsd), global-norm clipping."""
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup: int = 50
  schedule: str = "cosine"  # cosine | wsd
  decay_fraction: float = 0.2  # wsd: final fraction of steps spent decaying
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0

  def __post_init__(self):
    _check_counts("optim", self, {
        "lr": _POSITIVE, "min_lr_ratio": _FRACTION, "warmup": _AT_LEAST_0, "schedule": _one_of(SCHEDULES),
        "decay_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"), "weight_decay": _NON_NEGATIVE, "b1": _BETA,
        "b2": _BETA, "clip_norm": _POSITIVE})


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Loop lengths, output, seed, compare-mode routes and the device mesh (data, fsdp); -1 = all the rest."""
  steps: int = 200
  eval_every: int = 100
  eval_batches: int = 8
  log_every: int = 10
  ckpt_every: int = 0  # 0 = only at the end
  out_dir: str = "runs/default"
  resume: bool = True  # continue from out_dir/ckpt when it holds a checkpoint
  seed: int = 0
  routes: tuple[str, ...] = ()  # non-empty: compare mode, one run per route
  mesh: tuple[int, ...] = (-1, 1)
  progress: bool = True
  compile_cache: str = "auto"  # JAX's persistent compilation cache: "auto" (platform.default_cache_dir), "none"
  # (or "off"), or a path
  kernels_first: bool = True  # compile the steps' Pallas kernels alone, in parallel, beside the step's compile
  # (fp4jax.compiling: 1-4 s off a 30M nvfp4 or quartet2 step's compile on an H200 host, docs/BENCHMARKS.md)

  def __post_init__(self):
    expand_home(self, "out_dir")
    _check_counts("run", self, {"steps": _AT_LEAST_1, "log_every": _AT_LEAST_1, "eval_batches": _AT_LEAST_1,
                                "eval_every": _AT_LEAST_0, "ckpt_every": _AT_LEAST_0, "seed": _SEED,
                                "out_dir": (bool, "a directory path, not empty")})
    from fp4jax import platform  # pylint: disable=g-import-not-at-top
    try:
      platform.cache_dir(self.compile_cache)  # the words it takes and refuses, bench's --compile-cache's too
    except ValueError as err:
      raise ConfigError(f"run.compile_cache={self.compile_cache!r}: {err}") from err
    if len(self.mesh) != 2 or any(d < 1 and d != -1 for d in self.mesh) or self.mesh.count(-1) > 1:
      raise ConfigError(f"run.mesh={list(self.mesh)} must be two sizes [data, fsdp], each >= 1 or one of them -1 "
                        f"(all the remaining devices)")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How fp4_dot runs (`fp4jax.Impl`; the numbers do not depend on it). `quantizer`: "auto" (the fused Pallas
  kernels on GPUs, XLA elsewhere), "pallas", "interpret" (Pallas interpret mode, slow: tests) or "xla" (XLA's
  reference quantizers, e.g. to measure what the kernels buy). `gemm`: "auto", "emulated", "fp8", "mosaic",
  "native". `split_tokens`: on a mesh of several devices each quantizes its own tokens with the kernels
  (`Impl.token_axes` "auto": the run's ("data", "fsdp") axes both split the batch), the whole batch's bits
  either way; false gathers the kernels' inputs as XLA partitions a kernel (it is new, and has not yet run on
  several GPUs)."""
  quantizer: str = "auto"
  gemm: str = "auto"
  split_tokens: bool = True

  def __post_init__(self):
    from fp4jax.ops import gemm, quantize  # pylint: disable=g-import-not-at-top
    _check_counts("kernels", self, {
        "quantizer": (lambda v: v in quantize.CHOICES, f"one of {quantize.CHOICES}"),
        "gemm": (lambda v: v in gemm.CHOICES, f"one of {gemm.CHOICES}")})

  def impl(self):
    """The `fp4jax.Impl` these settings name."""
    from fp4jax import Impl  # pylint: disable=g-import-not-at-top
    return Impl(quantizer=self.quantizer, gemm=self.gemm, token_axes="auto" if self.split_tokens else ())


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  route: str = "bf16"
  rules: RulesConfig = RulesConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  run: RunConfig = RunConfig()
  kernels: KernelConfig = KernelConfig()

  def __post_init__(self):
    _check_route("route", self.route)
    for i, name in enumerate(self.run.routes):
      _check_route(f"run.routes[{i}]", name)
    if len(set(self.run.routes)) != len(self.run.routes):  # one out_dir per route: a repeat would train it twice
      raise ConfigError(f"run.routes={list(self.run.routes)} names a route twice")
    from fp4jax.nn.llama import LlamaConfig  # pylint: disable=g-import-not-at-top
    n_layers = LlamaConfig.preset(self.model.preset, **self.model.overrides).n_layers  # checked by ModelConfig
    if self.rules.bf16_first + self.rules.bf16_last > n_layers:
      raise ConfigError(f"rules.bf16_first={self.rules.bf16_first} + rules.bf16_last={self.rules.bf16_last} "
                        f"blocks in bf16 is more than the model's {n_layers} blocks")


def _check_route(where: str, name: str) -> None:
  from fp4jax import route as route_lib  # pylint: disable=g-import-not-at-top
  if name not in route_lib.PRESETS:
    raise ConfigError(f"{where}={name!r} is not a route; routes: {list(route_lib.PRESETS)}")


def convert(value: Any, tp: Any, where: str) -> Any:
  """Converts a YAML/CLI value to type `tp` (a field type: scalar, tuple, dict or config dataclass) or raises
  ConfigError naming the key `where`."""
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):  # built already: `replace` checks a ModelConfig's converted overrides again
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return build(tp, value, where)
  if origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return dict(value)
  if origin is tuple:
    (item_tp, _) = typing.get_args(tp)
    if isinstance(value, (str, int, float)):
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where}: expected a list, got {value!r}")
    return tuple(convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
  if origin in (typing.Union, types.UnionType):  # the first member type that takes the value (bool | str); X | None
    members = [m for m in typing.get_args(tp) if m is not type(None)]  # takes YAML's null (or ~) as None
    if value is None and len(members) < len(typing.get_args(tp)):
      return None
    for member in members[:-1]:
      try:
        return convert(value, member, where)
      except ConfigError:
        pass
    return convert(value, members[-1], where)
  if tp is bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
      return value.lower() == "true"
    if not isinstance(value, bool):
      raise ConfigError(f"{where}: expected true/false, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, (int, str, float)):
      raise ConfigError(f"{where}: expected an int, got {value!r}")
    try:  # a float (32.0, YAML 1.1's "1e3" string) must be integral; an int or int string is taken exactly
      number = float(value) if isinstance(value, float) or (isinstance(value, str) and "e" in value.lower()) else None
      out = int(value) if number is None else int(number)
    except (ValueError, OverflowError):  # OverflowError: "1e400", "inf"
      raise ConfigError(f"{where}: expected an int, got {value!r}") from None
    if number is not None and out != number:
      raise ConfigError(f"{where}: expected an int, got {value!r}")
    if abs(out) >= 2**63:  # past what JAX's integers hold
      raise ConfigError(f"{where}: {value!r} is too large (|value| < 2**63)")
    return out
  if tp is float:
    if isinstance(value, bool):
      raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
      return float(value)  # also YAML's "1e-3", which YAML 1.1 reads as a string
    except (TypeError, ValueError):
      raise ConfigError(f"{where}: expected a number, got {value!r}") from None
  if tp is str:
    if isinstance(value, bool) and (where, value) in _WORDS_READ_AS_BOOL:
      return _WORDS_READ_AS_BOOL[where, value]
    read_as = _read_as(value)
    if read_as:
      raise ConfigError(f"{where}: expected a string, got {value!r} (YAML reads {read_as}: quote the value)")
    if not isinstance(value, (str, int, float)):
      raise ConfigError(f"{where}: expected a string, got {value!r}")
    return str(value)
  raise TypeError(f"{where}: unsupported field type {tp}")


def _read_as(value: Any) -> str | None:
  """What YAML made of an unquoted word that was likely meant as a string (`run.out_dir=2026-12-06`, `=~/runs`), to
  say in the error; None for other values."""
  if isinstance(value, bool):
    return "yes/no/on/off unquoted as true/false"
  if value is None:
    return "~ and null unquoted as no value"
  if isinstance(value, datetime.date):
    return "a date such as 2026-12-06 unquoted as a date"
  return None


def build(cls: type, raw: dict[str, Any], where: str = "") -> Any:
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(raw) - set(names))
  if unknown:
    prefix = f"{where}." if where else ""
    hint = "; a `study:` config runs with `python -m train.study --config ...`" if not where and "study" in unknown \
        else ""
    raise ConfigError(f"unknown key(s) {[prefix + k for k in unknown]}; valid keys in "
                      f"{where or 'the top level'}: {names}{hint}")
  kwargs = {k: convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in raw.items()}
  return cls(**kwargs)


def _declared_type(parts: list[str], sections: dict[str, Any]) -> Any:
  """The type the schema declares for the dotted key `parts` (`sections`: the top-level keys' types); None for a
  key it does not declare (an unknown key, one under a dict such as model.overrides), which `build` names."""
  tp: Any = sections.get(parts[0])
  for p in parts[1:]:
    if not dataclasses.is_dataclass(tp):
      return None
    tp = typing.get_type_hints(tp).get(p)
  return tp


def _set_dotted(raw: dict[str, Any], assignment: str, sections: dict[str, Any]) -> None:
  """Sets the dotted `key.sub=value`. The value of a key declared `str` is its text as typed (less surrounding
  spaces, and the quotes around a quoted one), so `run.out_dir=1.10` names the folder 1.10, not 1.1; a key declared
  a list of strings is read as a YAML list whose items keep their text (`data.sources=[a, 1.10]` is a and 1.10);
  any other value is read as YAML, as in a config file (`[a, b]`, `null`, `1e-3`)."""
  if "=" not in assignment:
    raise ConfigError(f"override {assignment!r} must look like key.sub=value")
  key, text = assignment.split("=", 1)
  parts = key.strip().split(".")
  tp = _declared_type(parts, sections)
  if tp is str and text.strip()[:1] not in ("'", '"'):
    value: Any = text.strip()
  else:
    try:  # YAML's base loader reads every scalar as its text (its quotes removed)
      loader = yaml.BaseLoader if tp == tuple[str, ...] else yaml.SafeLoader
      value = yaml.load(text, Loader=loader) if text.strip() else ""
    except yaml.YAMLError as e:
      raise ConfigError(f"override {assignment!r}: the value is not valid YAML ({getattr(e, 'problem', e)}); "
                        f"quote lists as --set 'key=[a,b]'") from e
  node = raw
  for p in parts[:-1]:
    child = node.setdefault(p, {})
    if not isinstance(child, dict):
      raise ConfigError(f"override {assignment!r}: {p!r} is not a section")
    node = child
  node[parts[-1]] = value


def with_overrides(raw: dict[str, Any], overrides: typing.Sequence[str] = (), sections: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
  """A copy of the raw (YAML) tree with each dotted `key.sub=value` override applied; nothing is checked yet.
  `sections`: the types of the top-level keys that `_set_dotted` reads string keys by (default: Config's)."""
  raw = _deepcopy(raw)
  sections = typing.get_type_hints(Config) if sections is None else sections
  for o in overrides:
    _set_dotted(raw, o, sections)
  return raw


def from_dict(raw: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
  cfg = build(Config, with_overrides(raw, overrides))
  if cfg.run.routes and any(o.split("=", 1)[0].strip() == "route" for o in overrides):
    raise ConfigError(f"--set route=... is not read in compare mode: the config runs run.routes="
                      f"{list(cfg.run.routes)}; set those instead, e.g. --set 'run.routes=[{cfg.route}]'")
  return cfg


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> Config:
  return from_dict(read_yaml(path), overrides)


def to_dict(cfg: Any) -> dict[str, Any]:
  """A YAML/JSON-friendly nested dict (tuples as lists)."""
  def plain(x):
    if isinstance(x, (tuple, list)):
      return [plain(v) for v in x]
    if isinstance(x, dict):
      return {k: plain(v) for k, v in x.items()}
    return x
  return plain(dataclasses.asdict(cfg))


def _deepcopy(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _deepcopy(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_deepcopy(v) for v in x]
  return x


# Settings a finished run's numbers do not depend on: its saved result holds whatever they are now. run.steps is
# left to the callers (train.check_out_dir: it sets the learning-rate schedule; the study: it is the token budget).
RESULT_NEUTRAL = {"run": {"steps", "eval_every", "log_every", "ckpt_every", "out_dir", "resume", "routes", "mesh",
                          "progress", "compile_cache", "kernels_first"},
                  "data": {"workers", "cache_dir"}, "kernels": {"quantizer", "gemm", "split_tokens"}}


def changed_settings(saved: dict[str, Any], now: dict[str, Any], *, also_neutral: dict[str, set[str]] | None = None
                     ) -> list[str]:
  """'key: saved -> now' for every result-relevant setting that differs between two `to_dict` trees (settings in
  RESULT_NEUTRAL, or in `also_neutral`, are left out).

  A section setting the saved tree lacks was added to Config after that run was saved, and counts as its
  default: a new setting defaults to what runs did before it existed (data.microbatches = 1, one pass)."""
  also_neutral = also_neutral or {}
  defaults = to_dict(Config())
  out = []
  for section, value in now.items():
    old = saved.get(section)
    if not isinstance(value, dict):
      out += [f"{section}: {old!r} -> {value!r}"] if old != value else []
      continue
    old = {**defaults.get(section, {}), **old} if isinstance(old, dict) else {}
    neutral = RESULT_NEUTRAL.get(section, set()) | also_neutral.get(section, set())
    out += [f"{section}.{k}: {old.get(k)!r} -> {v!r}" for k, v in value.items()
            if k not in neutral and old.get(k) != v]
  return out


def replace(cfg: Config, **sections: Any) -> Config:
  """`replace(cfg, route="mxfp4", run={"out_dir": ...})`: a copy with fields or section fields replaced."""
  updates = {}
  for name, v in sections.items():
    cur = getattr(cfg, name)
    updates[name] = dataclasses.replace(cur, **v) if isinstance(v, dict) and dataclasses.is_dataclass(cur) else v
  return dataclasses.replace(cfg, **updates)

