#!/usr/bin/env bash
# The H200 measurements in docs/BENCHMARKS.md, in one GPU session (run from the repo root on the GPU machine,
# whose python3 already has jax 0.11.2 (cuda13), flax, optax, orbax, tiktoken):
#   OUT=/some/dir DATA=/path/with/wiki_xz_and_gpt2 scripts/gpu_bench.sh [parts...]
# (TRAIN_ARGS adds train overrides, e.g. "--set kernels.quantizer=xla --set run.routes=[nvfp4_tile_local]";
# COMPILE_PRESETS (30m 125m 1b), REPEAT (2) and COMPILE_PASSES (on|off) shape the compile part)
# parts: tests verify quantize dot compile step train mesh (default: tests quantize dot train; mesh needs a
# host of several GPUs).
# Logs and results land in $OUT.
# Limits: one device call allows 600 s. The GPU tests run in TEST_WORKERS (4) pytest processes that allocate
# GPU memory as they need it: 83 of them took 57 s on an H200 that way (2026-12-05), where one process had
# taken 171 s for 73 (2026-12-03), most of it compiling kernels. The train part compiles each route before its
# steps (60-95 s for FP4 routes). Run the parts that fit in separate calls.
set -uo pipefail
OUT=${OUT:-runs/gpu_bench}
DATA=${DATA:-.gpu/data}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=("${@:-tests quantize dot train}")
DOT_FLAGS=--xla_gpu_enable_triton_gemm=false  # cuBLAS for every dot: 1-4 s compiles, same GEMM speed
parts=(${parts[*]})
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
step_8b() {  # ROUTE unrolled|scan: one row of 12 Llama-3-8B blocks, 2 x 4096 tokens, into $OUT/step_8b_ROUTE_HOW.json
  timeout ${STEP_LIMIT:-150} python3 -m bench step --preset llama3_8b --layers 12 --tokens 2x4096 --iters 3 \
    $([ "$2" = scan ] && echo --scan) --out "$OUT/step_8b_$1_$2.json" --routes "$1" 2>&1 | grep -v Delay | tail -1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      log "GPU tests"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TESTS_LIMIT:-400} python3 -m pytest -q -m gpu \
        -n ${TEST_WORKERS:-4} -p no:cacheprovider --durations=20 tests 2>&1 | tail -45 ;;
    verify)
      log "GPU tests of the kernels, numerics and programs compiled beside their kernels (fp4jax.compiling)"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TESTS_LIMIT:-400} python3 -m pytest -q -m gpu \
        -n ${TEST_WORKERS:-4} -p no:cacheprovider tests/ops/quantize tests/test_dot_kernels.py tests/numerics \
        tests/test_compiling.py 2>&1 | tail -20
      log "fp4_dot on a mesh: kernels on each device's rows (8 CPU devices) and programs compiled for two H200s"
      timeout ${TESTS_LIMIT:-400} python3 -m pytest -q -p no:cacheprovider tests/ops/quantize/test_rows.py 2>&1 \
        | tail -5 ;;
    quantize)
      log "fused quantizer bench"
      timeout ${QUANTIZE_LIMIT:-400} python3 -m bench quantize --out "$OUT/quantize" \
        --variants "${QUANTIZE_VARIANTS:-rne/ocp,w32x32/noclip/0.87,views dY sr|rne,views X rne|rne+h32,views dY sr|rne+h32,nv rne|rne,nv dY sr|rne,nvtile rne|rne,nvtile dY sr|rne,nv X rne|rne+rht16,nv dY sr|sr+rht16,nv W 16x16,eden dY views}" \
        2>&1 | tail -60 ;;
    dot)
      log "fp4_dot bench (Llama-8B shapes, M=16384)"
      XLA_FLAGS=$DOT_FLAGS timeout ${DOT_LIMIT:-400} python3 -m bench dot --no-gemm-rows --iters 10 \
        --no-check --unfused --routes bf16 mxfp4 mxfp4_h32 nvfp4 nvfp4_tile_local quartet2 --out "$OUT/dot.json" \
        2>&1 | grep -v "compiling and timing" | tail -60 ;;
    compile)
      # Issue 12's measurement: each route's first call (trace + lower + compile, cold) in fresh processes, as
      # training runs it (--scan auto), medians and ratios to bf16 printed last. 30M took 111 s with REPEAT=2.
      # KERNELS_FIRST="on off" also times them with their Pallas kernels compiled in the program instead of alone
      # beside its compile (fp4jax.compiling, the default: 1-4 s off a 30M FP4 step's compile on an H200 host).
      for preset in ${COMPILE_PRESETS:-30m 125m 1b}; do
        case "$preset" in 30m) tokens=64x512 ;; 125m) tokens=16x1024 ;; *) tokens=8x2048 ;; esac
        for kf in ${KERNELS_FIRST:-on}; do
          log "first calls, cold, ${REPEAT:-2} fresh processes each: Llama-$preset $tokens, kernels beside: $kf"
          timeout ${COMPILE_LIMIT:-300} python3 -m bench --compile-cache off --kernels-first "$kf" compile \
            --step "$preset" --tokens "$tokens" --scan auto --repeat ${REPEAT:-2} \
            --routes bf16 mxfp4 nvfp4 quartet2 2>&1 | tail -5
        done
      done
      [ "${COMPILE_PASSES:-on}" = off ] && continue
      log "where the 30M first call goes (one process, XLA's longest compile events)"
      timeout ${COMPILE_LIMIT:-300} python3 -m bench --compile-cache off compile --step 30m --tokens 64x512 \
        --scan auto --passes 40 --routes bf16 nvfp4 quartet2 > "$OUT/compile_passes.log" 2>&1
      grep -E "^  30m|first call" "$OUT/compile_passes.log" ;;
    step)
      # One process per route: besides the step, each compiles its state initializer (19-28 s at these sizes,
      # docs/BENCHMARKS.md "State initialization took longer than compiling the step").
      log "whole train steps: 12 Llama-3-8B blocks and Llama-1B, unrolled bf16 and scanned routes"
      # Unrolled FP4 blocks compile for ~30 s at this size and ran ~10% faster than scanned (2026-12-03).
      for route in ${UNROLLED_ROUTES:-bf16 mxfp4 fp8}; do step_8b "$route" unrolled; done
      for route in ${STEP_ROUTES:-mxfp4 mxfp4_h32 nvfp4}; do step_8b "$route" scan; done
      timeout ${STEP_LIMIT:-150} python3 -m bench step --preset 1b --tokens 8x2048 --iters 3 --routes bf16 2>&1 \
        | grep -v Delay | tail -1
      timeout ${STEP_LIMIT:-150} python3 -m bench step --preset 1b --tokens 8x2048 --iters 3 --scan --profile \
        --out "$OUT/step_1b_mxfp4.json" --routes mxfp4 2>&1 | grep -v Delay | tail -6 ;;
    train)
      log "Llama-125M on Wikipedia: bf16 vs mxfp4_h32 vs nvfp4"
      timeout ${TRAIN_LIMIT:-550} python3 -m train --config configs/llama_125m_wiki.yaml \
        --set "data.sources=[$DATA/wiki/*.xz]" --set "data.tokenizer_path=$DATA/gpt2" \
        --set run.steps=${STEPS:-300} --set run.eval_every=100 --set optim.warmup=30 --set run.eval_batches=8 --set run.ckpt_every=0 \
        --set data.batch_size=16 --set run.progress=false --set "run.out_dir=$OUT/train" ${TRAIN_ARGS:-} 2>&1 \
        | tail -40 ;;
    mesh)
      # Issue 16 (on a host of several GPUs): the same global batch on one GPU, then on every GPU of the host,
      # data parallel and FSDP, per route; each run's table gives tokens/s and peak memory. fp4_dot quantizes
      # each GPU's own tokens (fp4jax.Impl.token_axes; checked on CPU devices and in programs compiled for two
      # H200s, never yet on GPUs).
      for route in ${MESH_ROUTES:-bf16 mxfp4}; do
        for how in "1gpu:[1,1]:0" "data:[-1,1]:" "fsdp:[1,-1]:"; do
          IFS=: read -r name mesh devices <<< "$how"
          log "Llama-1B $route, $name (run.mesh=$mesh)"
          env ${devices:+CUDA_VISIBLE_DEVICES=$devices} timeout ${MESH_LIMIT:-280} python3 -m train \
            --config configs/llama_1b.yaml --set route=$route --set "run.mesh=$mesh" \
            --set "data.sources=[$DATA/wiki/*.xz]" --set "data.tokenizer_path=$DATA/gpt2" \
            --set run.steps=${MESH_STEPS:-30} --set run.eval_every=0 --set run.ckpt_every=0 --set run.progress=false \
            --set "run.out_dir=$OUT/mesh_${route}_$name" 2>&1 | tail -4
        done
      done ;;
    *) echo "unknown part $part (tests verify quantize dot compile step train mesh)"; exit 2 ;;
  esac
done
