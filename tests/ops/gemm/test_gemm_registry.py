"""The GEMM registry: device generations, the choice among backends, and every backend equal to emulated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics.reference import quantize
from fp4jax.ops import gemm
from fp4jax.ops.gemm import registry


def _data():
  kx, kw = jax.random.split(jax.random.key(0))
  return jax.random.normal(kx, (64, 128)), jax.random.normal(kw, (128, 96)) * 0.1


def _close(actual, desired):
  desired = np.asarray(desired, np.float32)
  np.testing.assert_allclose(np.asarray(actual, np.float32), desired, rtol=1e-5,
                             atol=1e-5 * np.abs(desired).max())


class _FakeDevice:

  def __init__(self, platform, compute_capability=None):
    self.platform, self.compute_capability = platform, compute_capability


@pytest.mark.parametrize("platform, cc, want", [
    ("cpu", None, "other"), ("gpu", "8.0", "other"), ("gpu", "9.0", "sm90"), ("gpu", "10.0", "sm100"),
    ("gpu", "12.0", "sm100"),
])
def test_device_generation(platform, cc, want):
  assert gemm.device_generation(_FakeDevice(platform, cc)) == want


@pytest.mark.parametrize("kind, want", [("NVIDIA H200", "sm90"), ("NVIDIA GH200 480GB", "sm90"),
                                        ("NVIDIA B200", "sm100"), ("NVIDIA A100-SXM4-80GB", "other")])
def test_device_generation_of_an_abstract_gpu_mesh(kind, want):
  """Lowering for an abstract GPU (`python -m bench program`, `--h200`) picks that GPU's GEMM backends."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh  # pylint: disable=g-import-not-at-top
  with use_abstract_mesh(AbstractMesh((1,), ("d",), abstract_device=AbstractDevice(kind, 132, "gpu"))):
    assert gemm.device_generation() == want
  assert gemm.device_generation() == ("other" if jax.default_backend() == "cpu" else gemm.device_generation())


@pytest.mark.parametrize("backend", [n for n in gemm.BACKENDS if n != "emulated"])
def test_backends_equal_emulated(backend):
  be = gemm.BACKENDS[backend]
  x, w = _data()
  pairs = {
      "mxfp4": (quantize(x, "mxfp4", axis=1), quantize(w, "mxfp4", axis=0, tile_2d=True)),
      "nvfp4": (quantize(x, "nvfp4", axis=1), quantize(w, "nvfp4", axis=0, tile_2d=True)),
      "nvfp4_tile": (quantize(x, "nvfp4_tile", axis=1), quantize(w, "nvfp4_tile", axis=0)),
  }
  ran = []
  for fmt, (a, b) in pairs.items():
    if be.supports(a, b):
      want = gemm.BACKENDS["emulated"].gemm(a, b, out_dtype=jnp.float32)
      _close(be.gemm(a, b, out_dtype=jnp.float32), want)
      ran.append(fmt)
  if not ran:
    pytest.skip(f"{backend} supports none of {list(pairs)} here")


def test_select():
  x, w = _data()
  a, b = quantize(x, "mxfp4", axis=1), quantize(w, "mxfp4", axis=0)
  assert gemm.select(a, b) == {"other": "emulated", "sm90": "fp8", "sm100": "native"}[gemm.device_generation()]
  assert gemm.select(a, b, "native") == "native"
  with pytest.raises(ValueError, match="unknown GEMM backend 'cublas'"):
    gemm.select(a, b, "cublas")
  with pytest.raises(ValueError, match="GEMM backend 'native' does not support"):
    gemm.select(a, quantize(w, "nvfp4", axis=0), "native")


def test_operand_form(monkeypatch):
  """Values where the backend multiplies bf16 values (Hopper's NVFP4 pairs), codes everywhere else; "auto"
  follows the device generation."""
  assert gemm.operand_form("nvfp4", "nvfp4", "fp8") == "values"
  assert gemm.operand_form("mxfp4", "nvfp4_tile", "fp8") == "values"
  assert gemm.operand_form("mxfp4", "mxfp4", "fp8") == "codes"
  assert gemm.operand_form("nvfp4", "nvfp4", "emulated") == "codes"
  assert gemm.operand_form("nvfp4", "nvfp4", "native") == "codes"
  assert gemm.operand_form("nvfp4", "nvfp4") == ("values" if gemm.device_generation() == "sm90" else "codes")
  for generation, want in (("sm90", "values"), ("sm100", "codes")):
    monkeypatch.setattr(registry, "device_generation", lambda: generation)
    assert gemm.operand_form("nvfp4", "nvfp4") == want
  with pytest.raises(ValueError, match="unknown GEMM backend"):
    gemm.operand_form("nvfp4", "nvfp4", "cublas")
