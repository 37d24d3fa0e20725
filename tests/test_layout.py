"""The package layout stays as docs/ARCHITECTURE.md draws it: layers import downward only, no cycles, the library
imports neither the training app nor the benchmarks, `import fp4jax` loads no Flax, and files stay short."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "fp4jax"
MAX_LINES = 460
# Layer of each top-level part of fp4jax: a module may import its own layer or lower ones (cycles are checked
# separately). ops/quantize and ops/gemm are one layer but must not import each other.
LAYERS = {"platform": 0, "compiling": 0, "numerics": 0, "ops": 1, "impl": 2, "route": 2, "routes": 2, "dot": 3, "diagnostics": 3,
          "nn": 4, "__init__": 5}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
  """{module: modules (or names of modules) it imports at any depth}, for every module of fp4jax."""
  graph = {}
  for path in LIBRARY.rglob("*.py"):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        found.add(node.module)
        found |= {f"{node.module}.{a.name}" for a in node.names}
    graph[_module_name(path)] = found
  return graph


def _part(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def test_library_imports_neither_train_nor_bench():
  for module, imported in _imports().items():
    bad = {m for m in imported if m.split(".")[0] in ("train", "bench")}
    assert not bad, f"{module} imports {bad}"


def test_layers_import_downward_only():
  graph = _imports()
  for module, imported in graph.items():
    for target in imported & set(graph):
      if module == "fp4jax" or target == "fp4jax":
        continue
      assert LAYERS[_part(target)] <= LAYERS[_part(module)], f"{module} (layer {_part(module)}) imports {target}"
      if module.startswith("fp4jax.ops.") and target.startswith("fp4jax.ops."):
        assert module.split(".")[2] == target.split(".")[2], f"{module} imports {target}: ops stay apart"


def test_no_import_cycles():
  graph = {m: {t for t in imported if t in _imports_keys()} for m, imported in _imports().items()}
  state: dict[str, int] = {}

  def visit(m, path):
    if state.get(m) == 1:
      raise AssertionError(f"import cycle: {' -> '.join(path + [m])}")
    if state.get(m) == 2:
      return
    state[m] = 1
    for t in graph[m]:
      if t != m and not (m.startswith(t + ".") or t == "fp4jax"):  # a package's own __init__ is not a cycle
        visit(t, path + [m])
    state[m] = 2

  for m in graph:
    visit(m, [])


def _imports_keys() -> set[str]:
  return {_module_name(p) for p in LIBRARY.rglob("*.py")}


def test_import_fp4jax_loads_no_flax():
  code = "import sys, fp4jax; fp4jax.fp4_dot; assert 'flax' not in sys.modules, 'flax'; fp4jax.FP4Linear; " \
         "assert 'flax' in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


def test_files_stay_short():
  long = {str(p.relative_to(ROOT)): n for p in LIBRARY.rglob("*.py") if (n := len(p.read_text().splitlines()))
          > MAX_LINES}
  assert not long, f"files over {MAX_LINES} lines: {long}"
