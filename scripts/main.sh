#!/usr/bin/env bash
# README main job: trains the same small Llama with bf16 and MXFP4 GEMMs on the Python stdlib (byte-level), on
# CPU, and writes runs/cpu_compare/{table.md,loss.png} (+ per-route metrics.jsonl, TensorBoard files,
# checkpoints). Extra arguments are forwarded: scripts/main.sh --set run.steps=50
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m train --config configs/cpu_compare.yaml "$@"
