#!/usr/bin/env bash
# On a machine with a GPU: run the gpu-marked tests, the quick benchmark and the quick "partial"
# scenario (data larger than the cache budget, with the CNN step), within 8 minutes, and write
# everything into one folder (first argument, else $OUT, else ./device-check).
# Uses the machine's own python3, torch and CuPy; installs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device-check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{
  date -u
  nvidia-smi || echo "nvidia-smi not available"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  python3 -c "import cupy; print('cupy', cupy.__version__)" || echo "no CuPy"
  python3 -c "import nvidia.dali; print('dali', nvidia.dali.__version__)" || echo "no DALI"
} > "$out/machine.txt" 2>&1
timeout 240 python3 -m pytest -m gpu -rs -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log"
status=$((status | ${PIPESTATUS[0]}))
timeout 120 python3 -m gpuload.cli bench --quick --step sleep --step-ms 2 --out "$out" 2>&1 | tee "$out/bench.log"
status=$((status | ${PIPESTATUS[0]}))
timeout 100 python3 -m gpuload.cli bench --quick --scenario partial --step cnn --out "$out/partial" 2>&1 \
  | tee "$out/bench-partial.log"
status=$((status | ${PIPESTATUS[0]}))
echo "device check finished with status $status; results in $out"
exit "$status"
