#!/usr/bin/env bash
# Checks and measures the whole tree on a GPU, in two device calls of under ten minutes each:
#   source tools/device_env.sh && SOAK_BUDGET=0 bash tools/h200_check.sh
#   source tools/device_env.sh && PHASES=2 bash tools/h200_check.sh
# Phase 1 (correctness, in parallel: none of it is timed): the GPU test suite, the
# soak, the engine loop. Phase 2 (timings, one at a time on a quiet GPU): the fp8-K/V
# and prefill bench rows, the first-step cost, the host overhead, both drop-ins beside
# the layer, the engine stream's host time with the real kernels. Each part has its
# own time cap so one slow part cannot starve the others; logs go to $OUT.
# Failures are named as they happen in gpu_failures.txt (a run cut by its cap still says which).
# Knobs (environment):
#   PHASES=1 (default) or 2, or "1 2" where a call may take longer than ten minutes (a full soak
#                        needs most of a call by itself: about 10,000 steps in 340 s next to the GPU tests)
#   SOAK_BUDGET=170      seconds of soak (0: no soak); TESTS_CAP=470; TESTS="tests/gpu"; FIRST_STEP_CAP=45
#                        (the suite alone took ~300 s on an H200 and more than 380 s on an H100; next
#                        to a soak it needs more still: for a full pass give it SOAK_BUDGET=0)
#   BENCH_ONLY, BENCH_VARIANTS, BENCH_PRIORITY=0, BENCH_BUDGET=80, BENCH_CAP=110: the bench rows and the
#                        launch-config variants timed beside the defaults (benchmarks/variants.py);
#                        BENCH_ARGS: more `mm3 bench` arguments (e.g. --profile-all: kernel times of every row)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PHASES=${PHASES:-1}
SOAK_BUDGET=${SOAK_BUDGET:-170}
TESTS=${TESTS:-tests/gpu}
BENCH_ONLY=${BENCH_ONLY:-"decode TP1 b(64|1) ctx64K q1|prefill TP1 8K new ctx(0|32K) sel-random"}
BENCH_VARIANTS=${BENCH_VARIANTS:-""}
cap() { local s=$1; shift; timeout "$s" "$@"; echo "[exit $? after cap ${s}s] $*"; }

if [[ $PHASES == *1* ]]; then
# -v names each failure as it happens (gpu_failures.txt), so a run cut by its cap still says which
( cap ${TESTS_CAP:-470} python3 -m pytest $TESTS -v -n 4 -p no:cacheprovider --durations=25 2>&1 \
    | tee "$OUT/gpu_tests.txt" | grep -E --line-buffered "FAILED|ERROR|exit 124" > "$OUT/gpu_failures.txt" ) &
if (( SOAK_BUDGET > 0 )); then
cap $((SOAK_BUDGET + 30)) python3 -m mm3_benchmarks.soak --device cuda --backend cuda --steps 10000 --budget-s "$SOAK_BUDGET" \
    > "$OUT/soak.txt" 2>&1 &
fi
cap 150 python3 examples/engine_loop.py --device cuda > "$OUT/engine_loop.txt" 2>&1 &
wait
tail -4 "$OUT/gpu_tests.txt"; head -20 "$OUT/gpu_failures.txt"; tail -6 "$OUT/soak.txt" 2>/dev/null
tail -3 "$OUT/engine_loop.txt" 2>/dev/null
fi
[[ $PHASES == *2* ]] || exit 0

{
  cap ${BENCH_CAP:-110} python3 -m mm3.cli bench --out "$OUT/b" --max-priority ${BENCH_PRIORITY:-0} --variant-priority ${BENCH_PRIORITY:-0} --peers "" \
      --budget-s ${BENCH_BUDGET:-80} --only "$BENCH_ONLY" ${BENCH_VARIANTS:+--variants "$BENCH_VARIANTS"} ${BENCH_ARGS:-}
  cap ${FIRST_STEP_CAP:-45} python3 -m mm3_benchmarks.first_step_cost --device cuda --backend cuda --decodes 64 \
      --context 65536 --prefills 0
  cap 40 python3 benchmarks/host_overhead.py --device cuda --tp 8 --batch 1 --context 4096
  cap 60 python3 benchmarks/vllm_dropin.py
  cap 90 python3 benchmarks/sglang_dropin.py
  cap 90 python3 benchmarks/host_overhead.py --stream --device cuda --steps 200
} > "$OUT/timings.txt" 2>&1
rm -f "$OUT"/b/*.png  # at most 8 files come back from the device
grep -v "^\[ *[0-9]*/" "$OUT/timings.txt" | tail -60
