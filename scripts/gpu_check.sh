#!/usr/bin/env bash
# The GPU checks, on a CUDA machine: the gpu test tier, the CPU suite on a machine that has a GPU, and the speed
# table (bench.py's bare step and train_a2.py's own loop at real shapes with random weights, no download).
#
#   bash scripts/gpu_check.sh gpu          # pytest -m gpu: the CUDA tier
#   bash scripts/gpu_check.sh suite        # the rest of the suite on this GPU machine (CPU tests pin the CPU)
#   bash scripts/gpu_check.sh table14      # A2-14B LoRA, 3 references, 81x480x832: bench.py and train_a2.py
#   bash scripts/gpu_check.sh table13      # Wan 1.3B full fine-tuning, 81x480x832: bench.py and train_a2.py
#   bash scripts/gpu_check.sh reach        # the memory targets (README), eager and compiled,
#                                          # each dry run (traced on fake tensors) printed before its measured step
#   bash scripts/gpu_check.sh peak         # (< 8 min on an H100) the compiled step's real peak for two plans of the
#                                          # rule (a2/memory.py) against its estimate: A2-14B LoRA 81x480x832 on
#                                          # 80 GB, Wan 1.3B full fine-tuning 81x480x832 on a 40 GB cap
#
# Wheels in .whl/ (diffusers, tyro, av, ... for a bare machine) are installed first when present. Results go to
# $OUT (or out/gpu_check): bench.jsonl (one JSON row per measurement) and the runs' metrics.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 A2_CACHE=${A2_CACHE:-/tmp/a2cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
FAST=(--compile --attention-backend _native_cudnn)

row() {  # row NAME BENCH_ARGS... -- TRAIN_ARGS...: bench.py, then train_a2.py from a precompute cache, compared
  local name=$1; shift
  local bench=() train=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do bench+=("$1"); shift; done
  shift
  train=("$@")
  local run=runs/$name
  rm -rf "$run" /tmp/cache-$name
  python3 train_a2.py "${train[@]}" --cache-dir /tmp/cache-$name --precompute --output-dir runs --run-name $name-pre \
    2>&1 | tail -3
  python3 train_a2.py "${train[@]}" --cache-dir /tmp/cache-$name --output-dir runs --run-name $name --log-every 2 \
    --ckpt-every 100000 --num-workers 4 2>&1 | grep -v "^train:" | tail -12
  cp "$run/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  python3 bench.py "${bench[@]}" --compare-run "$run" --out "$OUT/bench.jsonl" 2>&1 | tail -3
}

case "${1:-gpu}" in
  gpu)
    python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tier.log" ;;
  suite)
    python3 -m pytest -q -m "not gpu" -p no:cacheprovider > "$OUT/cpu_suite.log" 2>&1 ;;
  table14)
    python3 -c "from data import make_synthetic_dataset; make_synthetic_dataset('/tmp/e2v480', 4, 69, (480, 832))"
    row a2-14b-lora --preset 14B --refs 3 --mode lora --frames 81 --height 480 --width 832 --steps 4 "${FAST[@]}" -- \
      --model random-14B --data-root /tmp/e2v480 --resolution 480 832 --num-frames 81 --max-steps 8 "${FAST[@]}" ;;
  table13)
    python3 -c "from data import make_synthetic_dataset; make_synthetic_dataset('/tmp/t2v480', 4, 81, (480, 832))"
    row wan13-full --preset 1.3B --refs 0 --mode full --frames 81 --height 480 --width 832 --steps 4 "${FAST[@]}" -- \
      --model random-1.3B --dataset-type t2v --data-root /tmp/t2v480 --resolution 480 832 --num-frames 81 \
      --training-type full --max-steps 12 "${FAST[@]}" ;;
  peak)  # bench.py's peak_mem_gb (torch.cuda.max_memory_allocated, GiB) against the plan's estimate_gb
    rm -f "$OUT/peak.jsonl"
    for args in "--preset 14B --refs 3 --mode lora" "--preset 1.3B --refs 0 --mode full --max-memory-gb 40"; do
      # shellcheck disable=SC2086
      timeout 240 python3 bench.py $args --frames 81 --height 480 --width 832 --steps 2 --warmup 2 \
        --attention-backend _native_cudnn --out "$OUT/peak.jsonl" 2>&1 | tail -2
    done
    python3 -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(f\"{r['preset']} {r['mode']}: measured peak {r['peak_mem_gb']:.2f} GiB, rule {r['estimate_gb']:.2f} GiB \"
          f\"({r['estimate_gb'] / r['peak_mem_gb'] - 1:+.1%}); {r['plan']}\")" "$OUT/peak.jsonl" | tee "$OUT/peak.txt" ;;
  reach)  # --max-memory-gb also caps the allocator there (set_per_process_memory_fraction): a smaller card
    both() {  # the dry run's traced peak (eager, on fake tensors), then the measured one (peak_mem_gb), same flags
      python3 bench.py "$@" --dry-run 2>&1 | grep -v Warning | tail -5 | tee -a "$OUT/dryrun.log"
      python3 bench.py "$@" --steps 3 --warmup 2 --out "$OUT/bench.jsonl" 2>&1 | tail -4
    }
    A14=(--preset 14B --refs 3 --mode lora --frames 81)
    # the rule plans eager and compiled steps differently (a2/memory.py); compiled is the CUDA default, and its dry
    # run prints the compiled accounting beside the eager trace
    for mode in "--compile False" ""; do
      both "${A14[@]}" --height 720 --width 1280 --attention-backend _native_cudnn $mode
      both "${A14[@]}" --height 480 --width 832 --attention-backend _native_cudnn $mode
      both "${A14[@]}" --height 480 --width 832 --max-memory-gb 24 --attention-backend _native_cudnn $mode
      both --preset 1.3B --refs 0 --mode lora --frames 81 --height 480 --width 832 --max-memory-gb 12 \
        --attention-backend _native_cudnn $mode
      both --preset 1.3B --refs 0 --mode full --frames 81 --height 480 --width 832 --attention-backend _native_cudnn \
        $mode
      both --preset 14B --refs 0 --mode lora --frames 81 --height 480 --width 832 --max-memory-gb 24 \
        --attention-backend _native_cudnn $mode  # a Wan 2.2 A14B expert's shape (T2V)
    done ;;
esac
