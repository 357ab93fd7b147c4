#!/usr/bin/env bash
# The GPU path in one pass, on a machine with a CUDA GPU: the environment, the CUDA code paths of
# each feature (scripts/gpu_features.py), the ResNet-50 smoke benchmark in bf16 and fp16
# (benchmarks/gpu_smoke.py) and the test suite with CUDA visible. Every figure and log goes to $OUT
# (default: a new temporary directory). It ends within BUDGET_S seconds (default 470): the suite gets
# whatever time the checks before it left.
#
#   OUT=gpu-out bash scripts/gpu_check.sh              # on the GPU machine, from the repository root
#   OUT=gpu-out bash scripts/gpu_check.sh --dry-run    # anywhere: the same steps on CPU, shortened
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${BUDGET_S:-470}
PYTHON=${PYTHON:-python3}
started=$(date +%s)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 REPLICATOR_PROGRESS=0
dry=""; smoke="--repeats 3 --steps 20 --warmup 5 --batch 64"
if [ "${1:-}" = "--dry-run" ]; then
  dry="--cpu-dry-run"; smoke="--repeats 1 --steps 1 --warmup 1"
fi
log="$OUT/check.log"
if [ -z "$dry" ]; then
  # The suite's launched jobs set PYTHONPATH themselves (to the repository): a .pth file in the lent machine's
  # interpreter lets them import replicator and whatever was installed beside it (PYTHONPATH's entries) too.
  site=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  tr ':' '\n' <<< "$PYTHONPATH" > "$site/replicator-gpu-check.pth" || echo "no .pth written in $site"
fi

{
  echo "== environment"
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== features on the GPU" | tee "$log"
timeout 200 "$PYTHON" scripts/gpu_features.py $dry --json "$OUT/features.json" --trace "$OUT/timeline.json" 2>&1 \
  | tee -a "$log" | grep -E "^(ok|FAIL)|passed"

for precision in bf16 fp16; do
  echo "== ResNet-50 smoke, $precision" | tee -a "$log"
  timeout 120 "$PYTHON" benchmarks/gpu_smoke.py $dry $smoke --precision "$precision" \
    --json "$OUT/gpu_smoke_$precision.json" 2>&1 | tee -a "$log" | grep -E "verified|ratio|\| "
done

left=$(( BUDGET_S - ($(date +%s) - started) ))
echo "== test suite with CUDA visible ($left s left)" | tee -a "$log"
if [ -n "$dry" ]; then
  tests="tests/test_topology.py"
else
  tests="tests"
fi
# -n 8: pytest-xdist where installed (16 cores); every multi-process test pins its processes to
# CPU and Gloo (replicator.testing.run_replicas), single-process tests see the GPU.
xdist=""; "$PYTHON" -c "import xdist" 2>/dev/null && xdist="-n 8"
timeout "$(( left > 30 ? left - 10 : 20 ))" "$PYTHON" -m pytest -q $xdist -p no:cacheprovider -rfE --timeout 150 \
  $tests > "$OUT/pytest.log" 2>&1
echo "pytest exit code $? (124: stopped at the time budget)" | tee -a "$log"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
echo "== done in $(( $(date +%s) - started )) s; files in $OUT"
