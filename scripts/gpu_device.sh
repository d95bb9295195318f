#!/bin/bash
# On a GPU machine, from the repo root: unpack the bundle (scripts/gpu_bundle.py --out .gpu/gpu_bundle),
# time the kernel table first, then the rest, each under a timeout (T1, T2 seconds); results in $OUT.
# FIRST=prefixes: those cases before the kernel table (T0 seconds), kernel by kernel too for the
# PROFILE=prefixes among them (run_gpu.py --profile).
set -u
OUT=${OUT:-$PWD/gpu_results}; mkdir -p "$OUT"
R=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
cd /tmp && tar xzf "$R/${BUNDLE:-.gpu/gpu_bundle.tar.gz}" || exit 3
export PYTHONUNBUFFERED=1
K=${K:-tc_,cc_,gemv_,skinny_,attn_,moe_}
if [ -n "${FIRST:-}" ]; then
  timeout ${T0:-200} python3 gpu_bundle/run_gpu.py --out "$OUT/first" --only "$FIRST" --repeat 30 \
    --profile "${PROFILE:-}" > "$OUT/first.log" 2>&1
  echo "first rc=$?"; grep -v '^{' "$OUT/first.log" | tail -40
  K=$(python3 -c "import sys; f=sys.argv[2].split(','); print(','.join(k for k in sys.argv[1].split(',') if k not in f))" "$K" "$FIRST")
fi
timeout ${T1:-240} python3 gpu_bundle/run_gpu.py --out "$OUT/kernels" --only $K --repeat 30 > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"; grep -v '^{' "$OUT/kernels.log" | tail -40
rest=$(python3 -c "
import json; m=json.load(open('gpu_bundle/manifest.json'))
print(','.join(sorted({c['case'] for c in m['cases'] if not c['case'].startswith(('tc_','cc_','gemv_','skinny_','attn_','moe_'))})))")
[ -z "$rest" ] && exit 0
timeout ${T2:-240} python3 gpu_bundle/run_gpu.py --out "$OUT/rest" --only "$rest" --repeat 30 > "$OUT/rest.log" 2>&1
echo "rest rc=$?"; grep -v '^{' "$OUT/rest.log" | tail -45
