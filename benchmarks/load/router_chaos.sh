#!/usr/bin/env bash
# Router chaos at full size: N streamed greedy requests (default 200) through `kvserve router`
# while its workers are SIGKILLed and restarted at random; 0 lost, 0 hung, every output equal to
# an unkilled reference. Colocated (2 replicas) and P/D (1 prefill + 2 decode workers).
#
#     benchmarks/load/router_chaos.sh [N_REQUESTS] [pytest args...]
#
# It runs tests/server/test_router_chaos.py (the suite runs it with 64 requests) with -s, so the
# "chaos[mode]: ... requests, ... kills, ... re-prefills" lines are printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 KVSERVE_CHAOS_REQUESTS="${1:-200}"
shift || true
exec python3 -m pytest -s -q -p no:cacheprovider tests/server/test_router_chaos.py -k chaos_kill "$@"
