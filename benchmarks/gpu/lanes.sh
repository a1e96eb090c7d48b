#!/usr/bin/env bash
# Single-GPU parts side by side on a multi-GPU machine, then the multi-GPU parts: each lane is
# one `run.sh` on its own GPU (CUDA_VISIBLE_DEVICES), in its own processes, writing into
# $OUT/lane<i>/; the parts after `--` then run on all GPUs into $OUT/all/. One device call then
# measures what would otherwise take one call per kind. Lanes share the host's CPU cores and
# memory, so host-bound figures are taken with the other lane busy (say so where they matter).
#
# Usage (repo root, on the GPU machine):
#   OUT=<dir> bash benchmarks/gpu/lanes.sh "PART[:S] PART..." "PART..." -- PART[:S] ...
#   (one quoted list per GPU, in GPU order; a list starting "@2,3 " runs on those GPUs instead;
#   the lists after `--` use every GPU)
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
lanes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do lanes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
pids=()
for i in "${!lanes[@]}"; do
  spec=${lanes[$i]} gpus=$i
  if [ "${spec:0:1}" = "@" ]; then  # "@2,3 PART ...": a lane of several GPUs (two-GPU parts side by side)
    gpus=${spec%% *}; gpus=${gpus#@}; spec=${spec#* }
  fi
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus SITE=/tmp/site_lane$i OUT=$OUT/lane$i \
    bash "$ROOT/benchmarks/gpu/run.sh" $spec > "$OUT/lane$i.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for i in "${!lanes[@]}"; do echo "== lane $i"; sed -n '/^part /,$p' "$OUT/lane$i.txt"; done
if [ $# -gt 0 ]; then
  OUT=$OUT/all bash "$ROOT/benchmarks/gpu/run.sh" "$@" > "$OUT/all.txt" 2>&1
  echo "== all GPUs"; sed -n '/^part /,$p' "$OUT/all.txt"
fi
# The device tool brings back at most 8 files of at most 16 MiB: one archive of everything (in
# 15 MiB pieces when bigger: cat results.tgz.part-* | tar xz), and the summaries.
if [ -z "${KEEP_DIRS:-}" ]; then
  (cd "$OUT" && { for f in lane*.txt all.txt; do [ -f "$f" ] && sed -n '/^part /,$p' "$f"; done; } > summary.txt
   tmp=$(mktemp -d) && tar czf "$tmp/results.tgz" --exclude=./summary.txt . && \
   find . -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} + && mv "$tmp/results.tgz" . && \
   if [ "$(stat -c %s results.tgz)" -gt 15728640 ]; then split -b 15m results.tgz results.tgz.part- && rm results.tgz; fi)
fi
