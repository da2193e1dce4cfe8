#!/usr/bin/env bash
# Everything GPU-only in one call of under 5 minutes (so a rerun fits 15 minutes of device time
# with the machine's start), on a machine with torch (CUDA 13), CuPy and torchvision but no DALI,
# using that machine's python3 and installing nothing. Each step's seconds on an H100/H200 are
# an estimate (nothing has run on a GPU yet): steps.tsv records what each took, and the limits
# below leave about 1.5x of it.
#
#   machine        (~10 s) nvidia-smi, the versions of python3's torch, CuPy, torchvision, DALI,
#                  and gpuload doctor --json (doctor.json)
#   truth          (~60 s) benchmarks/device_truth.py: the CUDA-path hazards of issue 34 made to
#                  bite (a stalled side stream under nvJPEG, a shrink while the prefetcher gathers,
#                  StreamGuard entries, a column cache out of memory, the epoch-start shrink), the
#                  data served checked; one JSON per check in truth/
#   gpu-tests      (~70 s) the gpu-marked tests, except the kernels' (junit: gpu-tests.xml), with the
#                  25 slowest durations in its log; no test scales with the card's memory
#   kernel-parity  (~30 s) the gpu-marked tests of tests/transforms: CuPy kernels against the torch reference
#   prefetch       (~15 s) benchmarks/bench_prefetch.py: loop wait with prefetching, pinned H2D bandwidth
#   timeline       (~10 s) benchmarks/bench_timeline.py: loader.timeline's cost on a cached epoch (CUDA
#                  events on the loop's stream), on and off alternately; under 1% could turn it on
#   cache-device   (~20 s) gpuload bench --quick: arrays in the device-tier cache against torch
#   cache-partial  (~15 s) gpuload bench --quick --scenario partial: arrays larger than the device budget
#   images         (~35 s) gpuload bench --quick --scenario images: the image path, decoded on the GPU
#                  without DALI (the nvjpeg backend) and transformed by the CuPy kernels, next to
#                  torchvision's decode_jpeg + v2 transforms on the GPU (the DALI-free baseline: ~5 s
#                  of the step, its 3 epochs of 256 images and nvJPEG's start)
#
# Each step has its own time limit and its exit status, duration and log are recorded; a step
# that fails or times out does not stop the next, and steps that no longer fit the budget
# are recorded as skipped. At the end benchmarks/device_check_summary.py writes summary.json
# (pass/fail counts, skip reasons, each truth check's verdict, the headline numbers: H2D GB/s
# pinned and pageable, the loop's wait with and without prefetching, the timeline's cost, samples/s
# against torch);
# if even that fails, a minimal summary.json is written here. Then
# everything but summary.json and steps.tsv is packed into logs.tar.gz (the device tool brings
# back at most 8 files; GPULOAD_CHECK_KEEP_FILES=1 keeps them loose).
#
# What only a CUDA driver runs, and which step or gpu test here runs it: benchmarks/cuda_only_lines.md.
#
# Usage: benchmarks/device_check.sh OUT_DIR   (default: $OUT, else ./device-check)
# GPULOAD_CHECK_STEPS="machine gpu-tests" runs only the steps named (for trying it out);
# GPULOAD_CHECK_DEVICE=cpu runs the truth step's dry run (its checks at small sizes on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${GPULOAD_CHECK_PYTHON:-python3}"
budget_s="${GPULOAD_CHECK_BUDGET_S:-265}"  # steps (~265 s estimated); with the summary and packing, under 5 minutes
device="${GPULOAD_CHECK_DEVICE:-cuda}"
only="${GPULOAD_CHECK_STEPS:-}"
started=$(date +%s)
steps="$out/steps.tsv"
printf 'step\tstatus\trc\tseconds\tlimit_s\tlog\n' > "$steps"

# step NAME LIMIT_S COMMAND...: run COMMAND under a time limit, log to NAME.log, record the outcome.
step() {
  local name="$1" limit="$2"; shift 2
  if [[ -n "$only" && " $only " != *" $name "* ]]; then
    return 0
  fi
  # The CPU dry run's limits are for a busy 2-core machine (CI at load 8: truth took over 100 s).
  [[ "$device" == cpu ]] && limit=$(( limit * 3 ))
  local left=$(( budget_s - ($(date +%s) - started) ))
  if (( left < 15 )); then
    printf '%s\tskipped\t\t0\t%s\t\n' "$name" "$limit" >> "$steps"
    echo "== $name: skipped, ${left}s left of the ${budget_s}s budget"
    return 0
  fi
  (( limit > left - 10 )) && limit=$(( left - 10 ))
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local seconds=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  local status=passed
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=failed; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$limit" "$name.log" >> "$steps"
  echo "   $status (rc $rc) in ${seconds}s"
  tail -n 3 "$out/$name.log" | sed 's/^/   | /'
}

machine_info() {
  date -u
  nvidia-smi || echo "nvidia-smi not available"
  "$python" - <<'EOF'
import importlib, json, platform
info = {"python": platform.python_version()}
for name in ("torch", "cupy", "torchvision", "nvidia.dali", "PIL", "numpy"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as error:
        info[name] = f"missing ({type(error).__name__})"
import torch
info["cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info(0)
    info["gpu_memory_gib"] = round(total / 2**30, 1)
print("MACHINE_JSON " + json.dumps(info))
EOF
  # What gpuload sees (driver, CUDA builds, NVRTC, memory, settings); a FAIL line is reported, not fatal here.
  "$python" -m gpuload.cli doctor --json > "$out/doctor.json" || echo "gpuload doctor exited $?"
}

pytest_args=(-q -rs -p no:cacheprovider -m gpu)
if "$python" -c "import pytest_timeout" 2>/dev/null; then
  pytest_args+=(--timeout=90)  # one hung test fails alone instead of taking the step with it
fi

export python out
export -f machine_info
step machine 60 bash -c machine_info  # seconds on a quiet machine; the limit is for a busy one
truth_check_s=45  # each check's limit; the CPU dry run's three times that, as the steps' (nvjpeg-stall, which
[[ "$device" == cpu ]] && truth_check_s=135  # imports torchvision, took over 45 s at load 14)
step truth 100 "$python" benchmarks/device_truth.py --device "$device" --out "$out/truth" --timeout "$truth_check_s"
step gpu-tests 110 "$python" -m pytest "${pytest_args[@]}" --durations=25 --junitxml="$out/gpu-tests.xml" \
  --ignore=tests/transforms tests
step kernel-parity 50 "$python" -m pytest "${pytest_args[@]}" --junitxml="$out/kernel-parity.xml" tests/transforms
step prefetch 35 "$python" benchmarks/bench_prefetch.py --quick --device cuda --json "$out/prefetch.json"
step timeline 30 "$python" benchmarks/bench_timeline.py --pairs 400 --device "$device" --json "$out/timeline.json"
step cache-device 35 "$python" -m gpuload.cli bench --quick --step sleep --step-ms 2 --epochs 2 \
  --out "$out/cache-device"
step cache-partial 30 "$python" -m gpuload.cli bench --quick --scenario partial --step sleep --step-ms 2 \
  --epochs 2 --out "$out/cache-partial"
step images 55 "$python" -m gpuload.cli bench --quick --scenario images --device cuda --samples 256 \
  --epochs 2 --torch-workers 4 --out "$out/images"
rm -rf "$out/images/sample-images"  # the generated photos need not come back

echo "== summary"
if ! timeout -k 5 15 "$python" benchmarks/device_check_summary.py "$out" > "$out/summary.log" 2>&1; then
  cat "$out/summary.log"
  printf '{"summary_error": "device_check_summary.py failed, see summary.log", "steps_tsv": "steps.tsv"}\n' \
    > "$out/summary.json"
fi
cat "$out/summary.json"
# The device tool brings back at most 8 files: keep summary.json and steps.tsv loose, pack the rest.
if [[ -z "${GPULOAD_CHECK_KEEP_FILES:-}" ]]; then
  (cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name summary.json ! -name steps.tsv ! -name logs.tar.gz \
     -printf '%P\n' | tar czf logs.tar.gz -T - && find . -mindepth 1 -maxdepth 1 ! -name summary.json \
     ! -name steps.tsv ! -name logs.tar.gz -exec rm -rf {} +)
fi
failed=$(awk -F '\t' 'NR > 1 && $2 != "passed" { n++ } END { print n + 0 }' "$steps")
echo "device check finished in $(( $(date +%s) - started ))s, $failed step(s) not passed; results in $out"
(( failed == 0 ))
