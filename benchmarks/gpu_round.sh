#!/usr/bin/env bash
# Run several issues' GPU scripts in one device call, each under its own time limit, and pack
# everything they wrote into $OUT/results.tgz (the device tool brings back at most 8 files).
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_round.sh "13:240" "12:280:--quick" ...
#   (issue:seconds[:one argument for that issue's script])
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for spec in "$@"; do
  IFS=: read -r n t arg <<< "$spec"
  script=benchmarks/gpu_issue$n.sh
  [ -f "$script" ] || { echo "== $n: no $script"; continue; }
  mkdir -p "$OUT/r/$n"
  echo "== issue $n (limit ${t}s)"
  start=$(date +%s)
  OUT="$OUT/r/$n" timeout -k 10 "$t" bash "$script" ${arg:+"$arg"} > "$OUT/r/$n/console.txt" 2>&1
  echo "rc=$? in $(( $(date +%s) - start ))s"; tail -15 "$OUT/r/$n/console.txt"
done
tar czf "$OUT/results.tgz" -C "$OUT/r" . && rm -rf "$OUT/r"
