#!/usr/bin/env bash
# Runs the test suite on a fresh machine: sets up .venv (Python >= 3.12, pinned JAX) and runs pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest -q -n "${FP4JAX_TEST_WORKERS:-auto}" --durations=15 "$@"
