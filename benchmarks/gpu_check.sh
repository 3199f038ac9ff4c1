#!/usr/bin/env bash
# The GPU check, in one command (`make gpu-check`): on a machine with one NVIDIA GPU and a
# Python whose torch (2.11-2.15) and triton are already installed - no network needed - it
# installs compile_rng from this checkout into that Python (no dependencies fetched: torch,
# sympy, numpy and filelock come with torch; depyf is needed only by compile_rng.dump, which
# the check does not call), runs the GPU test suite, the throughput benchmark and an Nsight
# Compute count of the kernels' executed instructions, and writes one report.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (PYTHON=... to pick the interpreter)
#
# Each phase has its own time limit, so one hung phase leaves the others' results; the
# whole check is sized to finish in under 8 minutes on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-check-out}}
PY=("${PYTHON:-python3}")
mkdir -p "$OUT"
REPORT=$OUT/gpu-check.md
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$REPORT"; }
: >"$REPORT"
say "# compile_rng GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
say '```'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$REPORT"
"${PY[@]}" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())" 2>&1 | tee -a "$REPORT"
say '```'

phase() {  # phase NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, note time and status
    local name=$1 limit=$2 t0=$SECONDS status
    shift 2
    echo "=== $name"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    status=$?
    say "- $name: exit $status in $((SECONDS - t0)) s$([ $status = 124 ] && echo " (stopped at its ${limit} s limit)")"
    return 0
}

# pip with the Python's own setuptools; where that fails, the package copied beside a
# dist-info that declares the Dynamo backend (what pip would have written)
copy_install() {
    local site
    site=$(mktemp -d)
    cp -r compile_rng "$site/" && cp -r passes "$site/compile_rng/passes" && mkdir "$site/compile_rng-0.1.0.dist-info" &&
    printf 'Metadata-Version: 2.1\nName: compile_rng\nVersion: 0.1.0\n' >"$site/compile_rng-0.1.0.dist-info/METADATA" &&
    printf '[torch_dynamo_backends]\ncompile_rng = compile_rng.compiled.backend:compile_rng_backend\n' \
        >"$site/compile_rng-0.1.0.dist-info/entry_points.txt" && echo "$site"
}
if ! timeout 90 "${PY[@]}" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
    if SITE=$(copy_install); then
        export PYTHONPATH=$SITE
        # -P (Python 3.11+): the copy, not the checkout's package, which lacks compile_rng.passes
        "${PY[@]}" -c "import sys; sys.exit(sys.version_info < (3, 11))" && PY+=(-P)
        say "- install: pip failed ($(tail -1 "$OUT/install.log")); copied to $SITE instead"
    else
        say "- install: pip failed ($(tail -1 "$OUT/install.log")) and so did the copy: nothing installed"
    fi
else
    say "- install: pip install -e . (no dependencies, no index)"
fi
phase import 60 "${PY[@]}" -c "import compile_rng, torch; print('compile_rng imported on torch', torch.__version__)"
phase tests 180 "${PY[@]}" -m pytest -q -p no:cacheprovider tests/gpu tests/test_triton_kernels.py \
    tests/test_stream_conformance.py tests/test_accelerator_path.py
phase bench 200 "${PY[@]}" benchmarks/bench_gpu.py --json "$OUT/bench-gpu.json"
phase host 60 "${PY[@]}" benchmarks/bench_gpu.py --host
# issue 64 item 2: do the polynomial normals' FMAs round as the model's (bitwise), and what they cost
phase normal-study 90 "${PY[@]}" benchmarks/normal_transform_study.py --run cuda
if command -v ncu >/dev/null; then
    phase ncu 60 ncu --kernel-name regex:_stream_kernel --launch-count 3 --clock-control none \
        --metrics smsp__inst_executed.sum,smsp__thread_inst_executed.sum,dram__bytes.sum,gpu__time_duration.sum \
        "${PY[@]}" benchmarks/bench_gpu.py --ncu-launches
fi

say ""
say "## tests"
say '```'
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -25 | tee -a "$REPORT"
say '```'
say "## throughput (bench_gpu.py)"
say '```'
tee -a "$REPORT" <"$OUT/bench.log" >/dev/null
say '```'
say "## host time per call of a small draw (bench_gpu.py --host)"
say '```'
tee -a "$REPORT" <"$OUT/host.log" >/dev/null
say '```'
say "## Box-Muller variants launched (normal_transform_study.py --run cuda)"
say '```'
tail -8 "$OUT/normal-study.log" | tee -a "$REPORT"
say '```'
if [ -f "$OUT/ncu.log" ]; then
    say "## Nsight Compute (executed instructions per element: smsp__thread_inst_executed / elements)"
    say '```'
    grep -E "_stream_kernel|inst_executed|dram__bytes|duration|==ERR|error" "$OUT/ncu.log" | head -40 | tee -a "$REPORT"
    say '```'
fi
echo "report: $REPORT"
