#!/usr/bin/env bash
# GPT-2 124M in bf16 on one GPU: the same side-by-side ratios as bench/run.py, plus
# kernel launches; writes bench/results/gpu.md. Sized to finish in under 8 minutes.
# With --fold, instead: fused AdamW (step scope, the fold in both scopes, eager
# clip_grad_norm_) into bench/results/gpu_fold.md, and peak memory per variant
# (bench/memory.py, max_memory_allocated) into bench/results/gpu_memory.txt; another
# 8 minutes or so, so a session with 15 minutes of device time runs the two apart.
#
#   bench/gpu.sh [--fold]                 # on a machine with a CUDA GPU
#   bench/gpu.sh --device cpu [--fold]    # dry run: a shrunken GPT-2 on the CPU, proves the script works
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEVICE=cuda
FOLD=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="${2:?--device needs cpu or cuda}"; shift 2 ;;
    --fold) FOLD=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [[ "$DEVICE" == "cuda" ]]; then
  SIZE=(--device cuda --dtype bfloat16)
  RUN=(--repeats 10 --steps 10)
  MAIN_OUT=bench/results/gpu.md FOLD_OUT=bench/results/gpu_fold.md MEMORY_OUT=bench/results/gpu_memory.txt
  POLICIES=global_clip,full,agc,sinkhorn
else
  SIZE=(--device cpu --scale 0.1)
  RUN=(--repeats 2 --steps 1)
  MAIN_OUT=- FOLD_OUT=- MEMORY_OUT=/dev/null
  POLICIES=global_clip,full
fi

if [[ "$FOLD" == 0 ]]; then
  "$PYTHON" bench/run.py --models gpt2_124m "${SIZE[@]}" --policies "$POLICIES" --compile-policies global_clip \
    --compile-samples 1 --no-pass-scaling "${RUN[@]}" --out "$MAIN_OUT"
else
  "$PYTHON" bench/run.py --models gpt2_124m "${SIZE[@]}" --optimizer adamw-fused --policies global_clip \
    --compile-policies '' --no-pass-scaling "${RUN[@]}" --out "$FOLD_OUT"
  if [[ "$DEVICE" == "cuda" ]]; then MEMORY_SIZE=(--device cuda); else MEMORY_SIZE=(--device cpu --scale 0.1 --steps 1); fi
  "$PYTHON" bench/memory.py --model gpt2_124m "${MEMORY_SIZE[@]}" --policy global_clip | tee "$MEMORY_OUT"
fi
