"""Running a test's script in a fresh Python process with N CPU devices: JAX fixes its device count when its
backend starts, so a test that needs a mesh of several devices cannot get one in the pytest process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).parents[1]


def run(script: str, devices: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python -c script *args` with `devices` CPU devices and the repository importable; the process must exit 0
  (the assertion shows the tail of its stderr)."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc
