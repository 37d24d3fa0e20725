#!/usr/bin/env bash
# The H200 measurements in docs/BENCHMARKS.md, in one GPU session (run from the repo root on the GPU machine,
# whose python3 already has jax 0.11.2 (cuda13), flax, optax, orbax, tiktoken):
#   OUT=/some/dir DATA=/path/with/wiki_xz_and_gpt2 scripts/gpu_bench.sh [parts...]
# parts: tests quantize dot train (default: all). Logs and results land in $OUT.
set -uo pipefail
OUT=${OUT:-runs/gpu_bench}
DATA=${DATA:-.gpu/data}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=("${@:-tests quantize dot train}")
parts=(${parts[*]})
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      log "GPU tests"
      timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -25 ;;
    quantize)
      log "fused quantizer bench"
      timeout 75 python3 -m fp4jax.bench quantize --out "$OUT/quantize" \
        --variants "rne/ocp,sr/noclip,w32x32/noclip/0.87,rne/ocp+fp8" 2>&1 | tail -30 ;;
    dot)
      log "fp4_dot bench (Llama-8B up projection, M=16384)"
      timeout 150 python3 -m fp4jax.bench dot --shapes 0 --routes bf16 mxfp4 mxfp4_h32 nvfp4 \
        --iters 10 --no-check --out "$OUT/dot.json" 2>&1 | tail -45 ;;
    train)
      log "Llama-125M on Wikipedia: bf16 vs mxfp4_h32 vs nvfp4"
      timeout ${TRAIN_LIMIT:-550} python3 -m train --config configs/llama_125m_wiki.yaml \
        --set "data.sources=[$DATA/wiki/*.xz]" --set "data.tokenizer_path=$DATA/gpt2" \
        --set run.steps=${STEPS:-300} --set run.eval_every=100 --set optim.warmup=30 --set run.eval_batches=8 --set run.ckpt_every=0 \
        --set data.batch_size=16 --set run.progress=false --set "run.out_dir=$OUT/train" 2>&1 | tail -40 ;;
    *) echo "unknown part $part (tests quantize dot train)"; exit 2 ;;
  esac
done
