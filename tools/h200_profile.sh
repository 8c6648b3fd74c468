#!/usr/bin/env bash
# Hardware counters of one step per case (Nsight Compute), and the kernels of a graph replay:
#   source tools/device_env.sh && bash tools/h200_profile.sh
# Knobs: CASES (benchmarks/profile_kernels.py's cases; "" for none), NCU_SET (full; "quick": the
# sections that say what bounds a kernel, a few passes each), KERNELS (an ncu kernel-name regex),
# GRAPH=0 (skip the graph replay's kernel list), OLD (a checkout of an older tree, e.g. build/old,
# whose graph replay is listed beside this one's).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CASES=${CASES:-"prefill-TP1-32K prefill-TP8-32K decode-TP1-b64-fp8kv decode-TP1-b64"}
ncu --version | tail -1
for c in $CASES; do
  if [[ ${NCU_SET:-full} == quick ]]; then
    what="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
  else
    what="--set ${NCU_SET:-full}"
  fi
  timeout 150 ncu --profile-from-start off --clock-control none $what ${KERNELS:+-k "regex:$KERNELS"} \
      python3 -m mm3_benchmarks.profile_kernels --case "$c" > "$OUT/ncu_$c.txt" 2>&1
  echo "[$c: exit $?] $(grep -c '^  [a-zA-Z_]' "$OUT/ncu_$c.txt") lines"
done
if [[ ${GRAPH:-1} == 1 ]]; then
  python3 -m mm3_benchmarks.profile_kernels --case graph-TP8-b1 > "$OUT/graph_kernels.txt" 2>&1
fi
if [[ -n "${OLD:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_old .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site_old "$OLD" >/dev/null
  (cd /tmp && PYTHONPATH=/tmp/site_old python3 -m mm3_benchmarks.profile_kernels --case graph-TP8-b1) \
      > "$OUT/graph_kernels_old.txt" 2>&1
fi
tail -n 22 "$OUT"/graph_kernels*.txt 2>/dev/null
