"""fp4jax.platform: the target platform, the apps' XLA flags and JAX options, the shared persistent compilation
cache and the garbage collector's freeze the apps compile in."""

import gc
import importlib
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import platform


def test_compiles_for_gpu_sees_an_abstract_gpu_mesh():
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh  # pylint: disable=g-import-not-at-top
  assert platform.compiles_for_gpu() == (jax.default_backend() == "gpu")
  mesh = AbstractMesh((1,), ("d",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
  with use_abstract_mesh(mesh):
    assert platform.compiles_for_gpu()


def test_set_xla_flags_keeps_the_users_values(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x")
  got = platform.set_xla_flags(("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=4"))
  assert got == "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x --xla_gpu_autotune_level=4"
  monkeypatch.delenv("XLA_FLAGS")
  assert platform.set_xla_flags() == " ".join(platform.DEFAULT_XLA_FLAGS)


FRAMES = "jax_traceback_in_locations_limit"


@pytest.fixture
def jax_options_restored():
  """The JAX options `set_jax_options` sets by default, as they were before the test."""
  before = {name: getattr(jax.config, name) for name, _ in platform.DEFAULT_JAX_OPTIONS}
  yield
  for name, value in before.items():
    jax.config.update(name, value)


def test_set_jax_options_keeps_the_users_values(monkeypatch, jax_options_restored):
  monkeypatch.delenv(FRAMES.upper(), raising=False)
  jax.config.update(FRAMES, 100)
  assert platform.set_jax_options() == {FRAMES: 1}
  assert getattr(jax.config, FRAMES) == 1
  monkeypatch.setenv(FRAMES.upper(), "10")  # JAX read it at import; here it stands for the user's choice
  jax.config.update(FRAMES, 10)
  assert platform.set_jax_options() == {}
  assert getattr(jax.config, FRAMES) == 10


def _called_from_here(x):
  with jax.named_scope("fp4jax_test_scope"):
    return jnp.sin(x) * 2


def test_the_apps_hlo_holds_one_frame_per_op_and_whole_op_names(monkeypatch, jax_options_restored):
  """What the options change: an operation's location is the frame that made it, not a chain of call sites
  (from which XLA:GPU builds each instruction's stack), and its op name keeps the name stack."""
  monkeypatch.delenv(FRAMES.upper(), raising=False)
  lowered = lambda: jax.jit(lambda x: _called_from_here(x) + 1).lower(jnp.ones(4))  # a new function: not cached
  jax.config.update(FRAMES, 100)
  assert "callsite(" in lowered().as_text(debug_info=True)
  platform.set_jax_options()
  located = lowered().as_text(debug_info=True)
  assert "callsite(" not in located and "test_platform.py" in located
  compiled = lowered().compile().as_text()
  assert 'op_name="jit(<lambda>)/fp4jax_test_scope/sin"' in compiled


@pytest.mark.parametrize("flags, error, match", [
    ("--xla_gpu_autotune_level=0", TypeError, "takes a tuple of flags, got the string"),
    (("xla_gpu_autotune_level=0",), ValueError, "of the form '--name=value', got 'xla_gpu_autotune_level=0'"),
    (("--xla_gpu_autotune_level=0 --xla_dump_to=x",), ValueError, "of the form '--name=value'"),
    ((None,), ValueError, "of the form '--name=value', got None"),
])
def test_set_xla_flags_refuses_what_xla_would_not_read(monkeypatch, flags, error, match):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  with pytest.raises(error, match=match):
    platform.set_xla_flags(flags)
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


@pytest.mark.parametrize("flags, want", [
    ("", False),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=1 --xla_dump_to=/tmp/x", True),
    ("--xla_gpu_exclude_nondeterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),  # the last one wins
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops_extra=true", False),
])
def test_deterministic_ops_reads_xla_flags(monkeypatch, flags, want):
  monkeypatch.setenv("XLA_FLAGS", flags)
  assert platform.deterministic_ops() is want


def test_default_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("FP4JAX_CACHE", str(tmp_path / "c"))
  assert platform.default_cache_dir() == tmp_path / "c"
  monkeypatch.delenv("FP4JAX_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert platform.default_cache_dir() == tmp_path / "fp4jax" / "jax"


_PROGRAM = """
import sys, jax, jax.numpy as jnp
from fp4jax import platform
platform.enable_compilation_cache(sys.argv[1])
f = jax.jit(lambda x: jnp.sin(x) @ x.T + float(sys.argv[2]))
print(float(f(jnp.ones((64, 64))).sum()))
"""


def _run(cache, constant, processes=1):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-c", _PROGRAM, str(cache), str(constant)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(processes)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  return [float(out) for out, _ in outs]


def test_cache_dir_reads_the_apps_setting(monkeypatch, tmp_path):
  """train's run.compile_cache and bench's --compile-cache take the same words."""
  monkeypatch.setenv("FP4JAX_CACHE", str(tmp_path / "c"))
  assert platform.cache_dir("auto") == tmp_path / "c"
  assert platform.cache_dir("none") is None and platform.cache_dir("off") is None
  assert platform.cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # `--set run.compile_cache=~/c` reaches it unexpanded
  assert platform.cache_dir("~/c") == tmp_path / "home" / "c"


@pytest.mark.parametrize("setting", ["on", "ON", " yes ", "True"])
def test_cache_dir_refuses_a_yes_for_a_directory(setting, tmp_path):
  """A word that asks for a cache without naming one ("on", "yes", "true", any case) was taken as a relative
  directory, which the apps then made in the working directory; ./on names such a directory."""
  with pytest.raises(ValueError, match=rf"^'{setting.strip()}' names no compilation cache directory: give 'auto' "
                                       rf"for the default directory, 'off' for none, or a path "
                                       rf"\(\./{setting.strip()} for a directory of that name\)$"):
    platform.cache_dir(setting)
  assert platform.cache_dir(f"./{setting.strip()}") == pathlib.Path.cwd() / setting.strip()
  assert platform.cache_dir(str(tmp_path / setting.strip())) == tmp_path / setting.strip()


def test_two_processes_share_one_compilation_cache(tmp_path):
  """Two processes compiling the same program into one cache directory at once both succeed; a third loads
  the entry (no new file) and computes the same number."""
  cache = tmp_path / "cache"
  first = _run(cache, 1.0, processes=2)
  entries = sorted(p.name for p in cache.rglob("*") if p.is_file())
  assert entries and first[0] == first[1]
  assert _run(cache, 1.0) == first[:1]
  assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == entries
  _run(cache, 2.0)  # another program: another entry
  assert len([p for p in cache.rglob("*") if p.is_file()]) > len(entries)


def test_a_relative_cache_directory_stays_where_it_was_named(monkeypatch, tmp_path):
  """A relative cache directory reached JAX relative, which opens it only at its first entry: after an
  os.chdir the entries went to a directory of that name under the new working directory."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("FP4JAX_CACHE", "env")
  assert platform.cache_dir("rel") == tmp_path / "rel" and platform.cache_dir("auto") == tmp_path / "env"
  assert platform.kernel_cache_dir("rel") == tmp_path / "rel-xla-kernels"
  try:
    assert platform.enable_compilation_cache("rel") == tmp_path / "rel"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "rel")
  finally:
    platform.enable_compilation_cache(None)


def test_cache_off(tmp_path):
  assert platform.enable_compilation_cache(None) is None
  assert jax.config.jax_compilation_cache_dir is None
  path = platform.enable_compilation_cache(tmp_path / "x")
  try:
    assert path.is_dir() and jax.config.jax_compilation_cache_dir == str(path)
  finally:
    platform.enable_compilation_cache(None)


@pytest.mark.parametrize("app", ["bench.__main__", "train.main"])
def test_importing_an_app_starts_no_backend(app, tmp_path):
  """The apps set XLA_FLAGS after their imports, and XLA reads it when the first backend starts: an import that
  starts one (a key or an array made at module level) would silently drop the flags. A dump directory given
  after the import must therefore still be used."""
  dump = tmp_path / "dump"
  code = (f"import os, {app}\nos.environ['XLA_FLAGS'] = '--xla_dump_to={dump}'\nimport jax\n"
          "jax.jit(lambda x: x + 1)(1.0)\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1],
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert dump.is_dir() and any(dump.iterdir()), f"importing {app} started a JAX backend"


def test_compile_initializer_gives_the_jitted_values():
  """The init compile options change how XLA fuses, never the values (and XLA accepts them here)."""
  def init(key):
    k1, k2 = jax.random.split(key)
    return {"a": jax.random.normal(k1, (64, 32)), "b": jax.random.normal(k2, (64, 32)) * 0.02,
            "zeros": jnp.zeros((8,))}

  key = jax.random.key(3)
  compiled = platform.compile_initializer(init, key)
  assert "xla_disable_hlo_passes" in platform.INIT_COMPILER_OPTIONS
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), compiled(key),
               jax.jit(init)(key))


def test_the_kernels_package_registers_the_triton_dialect_module():
  from jax._src.lib import triton  # pylint: disable=g-import-not-at-top
  importlib.import_module("fp4jax.ops.quantize.pallas")
  assert sys.modules[platform.TRITON_DIALECT_LOOKUP] is triton.dialect
  assert platform.alias_triton_dialect_module()


def test_lowering_a_kernel_tries_no_missing_dialect_module(monkeypatch):
  """Without the alias, MLIR's bindings tried three missing "<prefix>.tt" modules per Triton op they built."""
  import builtins  # pylint: disable=g-import-not-at-top
  from bench import triton as bench_triton  # pylint: disable=g-import-not-at-top
  missing, real_import = [], builtins.__import__

  def spy(name, *args, **kwargs):
    if name.endswith(".tt") and name not in sys.modules:
      missing.append(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", spy)
  assert "tt.store" in bench_triton.triton_ir(bench_triton.KERNELS["mx rne"], (64, 64))
  assert not missing, missing[:3]


def test_triton_dialect_alias_replaces_nothing(monkeypatch):
  """A module already under the lookup name (imported, or only findable) is left alone."""
  import types  # pylint: disable=g-import-not-at-top
  name = platform.TRITON_DIALECT_LOOKUP
  other = types.ModuleType(name)
  monkeypatch.setitem(sys.modules, name, other)
  assert platform.alias_triton_dialect_module() and sys.modules[name] is other
  monkeypatch.delitem(sys.modules, name)
  monkeypatch.setattr(platform.importlib.util, "find_spec", lambda n: object() if n == name else None)
  assert not platform.alias_triton_dialect_module() and name not in sys.modules


def test_old_objects_frozen_freezes_inside_and_unfreezes_after():
  """Inside `old_objects_frozen` the objects alive on entry are out of the collector's reach (frozen), after it
  none is, an error inside included. (The interpreter may freeze its start-up objects: unfrozen first, so that
  the freeze shows.)"""
  gc.unfreeze()
  holder = [object()]  # an object alive on entry
  with platform.old_objects_frozen():
    assert gc.get_freeze_count() >= len(holder)
  assert gc.get_freeze_count() == 0
  with pytest.raises(KeyError):
    with platform.old_objects_frozen():
      assert gc.get_freeze_count() > 0
      raise KeyError("inside")
  assert gc.get_freeze_count() == 0
