#!/usr/bin/env bash
# GPT-2 124M in bf16 on one GPU: the same side-by-side ratios as bench/run.py, plus
# kernel launches; writes bench/results/gpu.md (SGD) and bench/results/gpu_fold.md (fused AdamW,
# with the fold). Sized to finish in under 8 minutes.
#
#   bench/gpu.sh                 # on a machine with a CUDA GPU
#   bench/gpu.sh --device cpu    # dry run: a shrunken GPT-2 on the CPU, proves the script works
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEVICE=cuda
if [[ "${1:-}" == "--device" ]]; then DEVICE="${2:?--device needs cpu or cuda}"; fi

if [[ "$DEVICE" == "cuda" ]]; then
  "$PYTHON" bench/run.py --models gpt2_124m --device cuda --dtype bfloat16 \
    --policies global_clip,full,agc,sinkhorn --compile-policies global_clip --compile-samples 1 --no-pass-scaling \
    --repeats 10 --steps 10 --out bench/results/gpu.md
  # fused AdamW beside SGD: step scope, the fold, and eager clip_grad_norm_ on the same optimizer
  "$PYTHON" bench/run.py --models gpt2_124m --device cuda --dtype bfloat16 --optimizer adamw-fused \
    --policies global_clip --compile-policies '' --no-pass-scaling --repeats 10 --steps 10 --out bench/results/gpu_fold.md
  "$PYTHON" bench/memory.py --model gpt2_124m --device cuda --policy global_clip | tee bench/results/gpu_memory.txt
else
  "$PYTHON" bench/run.py --models gpt2_124m --device cpu --scale 0.1 --policies global_clip,full \
    --compile-policies global_clip --compile-samples 1 --no-pass-scaling --repeats 2 --steps 1 --out -
fi
