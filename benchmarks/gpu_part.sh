# Sourced by the GPU call scripts. part <seconds> <log> <command...>: runs the command under its
# own time limit with its output in <log>, then prints "== <log name> rc=<exit status> in <s>s".
part() {
  local t=$1 log=$2; shift 2
  local s rc
  s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$log" 2>&1
  rc=$?
  echo "== $(basename "$log" .txt) rc=$rc in $(( $(date +%s) - s ))s"
}
