#!/usr/bin/env bash
# GPT-2 124M in bf16 on one GPU: the side-by-side ratios of bench/run.py, each mode sized
# to finish inside one 10-minute device call (a session has 15 minutes of device time; --fold
# ran in 575 s, --combo and --memory together in one call; the main mode's size is an estimate).
#
#   bench/gpu.sh                 # SGD: four policies, graph and step scope, eager; kernel launches,
#                                # cold compile -> bench/results/gpu.md
#   bench/gpu.sh --fold          # fused AdamW: global clip and the full policy, graph and step
#                                # scope, the fold in both scopes (the full policy's: step scope,
#                                # the update in the step program), eager clip_grad_norm_, cold
#                                # compile -> bench/results/gpu_fold.md (9.5 minutes on an H200 with
#                                # 7 repeats before the full policy's fold; 5 now, an estimate)
#   bench/gpu.sh --combo         # fused AdamW, global clip: every variant beside a twin compiled with
#                                # Inductor's combo kernels (independent kernels launched as one; the
#                                # step program alone in step scope) -> bench/results/gpu_combo.md;
#                                # CODE_DIR=dir keeps the generated code there. The step program now
#                                # compiles with them by default, so its step-scope rows, twin or not,
#                                # time the library's default (390 s on an H200, --memory beside it)
#   bench/gpu.sh --memory        # peak max_memory_allocated per variant, a process each, all at once
#                                # (bench/memory.py) -> bench/results/gpu_memory.txt
#   bench/gpu.sh --device cpu [--fold|--memory]   # dry run: a shrunken GPT-2 on the CPU
#
# The device image's torch may be older than the one fxgrad is tested against; the
# results' header names the version that ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEVICE=cuda
MODE=main
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="${2:?--device needs cpu or cuda}"; shift 2 ;;
    --fold) MODE=fold; shift ;;
    --combo) MODE=combo; shift ;;
    --memory) MODE=memory; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [[ "$DEVICE" == "cuda" ]]; then
  SIZE=(--device cuda --dtype bfloat16)
  RUN=(--repeats 7 --steps 10) FOLD_RUN=(--repeats 5 --steps 10)
  MAIN_OUT=bench/results/gpu.md FOLD_OUT=bench/results/gpu_fold.md MEMORY_OUT=bench/results/gpu_memory.txt
  COMBO_OUT=bench/results/gpu_combo.md COMBO_RUN=(--repeats 11 --steps 10)
  POLICIES=global_clip,full,agc,sinkhorn
  MEMORY_SIZE=(--device cuda)
else
  SIZE=(--device cpu --scale 0.1)
  RUN=(--repeats 2 --steps 1) FOLD_RUN=(--repeats 2 --steps 1)
  MAIN_OUT=- FOLD_OUT=- MEMORY_OUT=/dev/null COMBO_OUT=- COMBO_RUN=("${RUN[@]}")
  POLICIES=global_clip,full
  MEMORY_SIZE=(--device cpu --scale 0.1 --steps 1)
fi

case "$MODE" in
  main)
    "$PYTHON" bench/run.py --models gpt2_124m "${SIZE[@]}" --policies "$POLICIES" --compile-policies global_clip \
      --compile-samples 1 --no-pass-scaling "${RUN[@]}" --out "$MAIN_OUT" ;;
  fold)
    "$PYTHON" bench/run.py --models gpt2_124m "${SIZE[@]}" --optimizer adamw-fused --policies global_clip,full \
      --compile-policies global_clip --compile-samples 1 --no-pass-scaling "${FOLD_RUN[@]}" --out "$FOLD_OUT" ;;
  combo)
    "$PYTHON" bench/run.py --models gpt2_124m "${SIZE[@]}" --optimizer adamw-fused --policies global_clip \
      --compile-policies '' --no-pass-scaling "${COMBO_RUN[@]}" --twin combo_kernels=True \
      ${CODE_DIR:+--code-dir "$CODE_DIR"} --out "$COMBO_OUT" ;;
  memory)
    "$PYTHON" bench/memory.py --model gpt2_124m "${MEMORY_SIZE[@]}" --policy global_clip --jobs 5 | tee "$MEMORY_OUT" ;;
esac
