#!/usr/bin/env bash
# The GPU checks, on a CUDA machine, in parts that each fit one call of a lease (scripts/gpu_check.py plans, runs
# and records them; docs/gpu.md holds what each part measured):
#
#   bash scripts/gpu_check.sh quick        # (<= 6 min on an H100) one gpu test per GPU-only path, each in its own
#                                          # pytest process under its budget (scripts/gpu_times.json)
#   bash scripts/gpu_check.sh rest [WORD]  # every other gpu-marked test (those whose id holds WORD)
#   bash scripts/gpu_check.sh speed        # (<= 4 min) bench.py: A2-14B LoRA at 81x480x832 (s/step, MFU, measured
#                                          # peak against the rule), the same with --fp8-base --fp8-matmul, and Wan
#                                          # 1.3B full fine-tuning planned and capped at 40 GB
#   bash scripts/gpu_check.sh quick speed  # parts in turn, in one call
#   bash scripts/gpu_check.sh PART --list  # the part's tests and their expected times (any machine, no GPU)
#
# Each part writes to $OUT/PART (or out/gpu_check/PART): results.jsonl (each test's result, time and failure text,
# as it ends), failures.txt, logs/, env.json; then appends its section to docs/gpu.md and its times to
# scripts/gpu_times.json, copies of which it leaves in $OUT/PART/record. A call killed at its limit leaves the
# results of the tests it finished: `python3 scripts/gpu_check.py record DIR` records them later, anywhere.
#
# Older parts:
#   bash scripts/gpu_check.sh suite        # the CPU suite on this GPU machine (CPU tests pin the CPU)
#   bash scripts/gpu_check.sh table14      # A2-14B LoRA, 3 references, 81x480x832: bench.py and train_a2.py
#   bash scripts/gpu_check.sh table13      # Wan 1.3B full fine-tuning, 81x480x832: bench.py and train_a2.py
#   bash scripts/gpu_check.sh reach        # the memory targets (README), eager and compiled,
#                                          # each dry run (traced on fake tensors) printed before its measured step
#
# Wheels in .whl/ (diffusers, tyro, av, ... for a bare machine) are installed first when present. A copy of the tree
# without .git names its commit in A2_COMMIT (the record says which code ran).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${2:-}" = "--list" ]; then  # before any GPU or wheel: a planner's look
  exec python3 scripts/gpu_check.py list "$1"
fi
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

part() {  # part NAME [WORD]: scripts/gpu_check.py runs it into $OUT/NAME, then records it
  local dir=$OUT/$1
  rm -rf "$dir" && mkdir -p "$dir"
  if [ "$1" = speed ]; then
    OUT=$dir python3 scripts/gpu_check.py speed
  else
    OUT=$dir python3 scripts/gpu_check.py run "$@"
  fi
  local rc=$?
  python3 scripts/gpu_check.py record "$dir" >/dev/null && mkdir -p "$dir/record" \
    && cp docs/gpu.md scripts/gpu_times.json "$dir/record/"
  echo "$1: exit $rc; failures (if any) in $dir/failures.txt; recorded in docs/gpu.md"
}

case "${1:-quick}" in
  quick|speed)
    for p in "${@:-quick}"; do
      case "$p" in quick|speed) part "$p" ;; *) echo "gpu_check.sh: quick and speed go together, not $p"; exit 2 ;;
      esac
    done ;;
  rest)
    part rest "${2:-}" ;;
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
  reach)  # --max-memory-gb also caps the allocator there (set_per_process_memory_fraction): a smaller card
    both() {  # the dry run's traced peak (eager, on fake tensors), then the measured one (peak_mem_gb), same flags
      python3 bench.py "$@" --dry-run 2>&1 | grep -v Warning | tail -5 | tee -a "$OUT/dryrun.log"
      python3 bench.py "$@" --steps 3 --warmup 2 --out "$OUT/bench.jsonl" 2>&1 | tail -4
    }
    A14=(--preset 14B --refs 3 --mode lora --frames 81)
    # the rule plans eager and compiled steps differently (a2/memory/memory.py); compiled is the CUDA default, and its dry
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
