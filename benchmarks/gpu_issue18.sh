#!/usr/bin/env bash
# One GPU-machine call for issue 18 on a single GPU: the P2P connector's NIXL tests on CUDA
# (tiny models, KV caches in VRAM), then benchmarks/pd_transfer.py once per transport (producer
# + consumer engines on one GPU, Llama-3.1-8B shape: transfer GB/s at 1K/4K/8K prompts, TTFT
# with the pulled KV vs recomputing, ceilings incl. the device-to-device copy) and the UCX
# transports the NIXL READs used (UCX_PROTO_INFO=y). NIXL wheels for this Python, if the
# machine lacks NIXL: put them in .whl_nixl/ (repo root); they go to /tmp/site (--no-deps).
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue18.sh   (about 4 minutes at most)
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
TAG=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ls .whl_nixl/*-$TAG-*.whl >/dev/null 2>&1; then  # this Python's nixl_cu13 + the meta wheel
  python3 -m pip install -q --no-deps --target /tmp/site .whl_nixl/*-$TAG-*.whl .whl_nixl/*-py3-none-any.whl \
    > "$OUT/nixl_install.txt" 2>&1
  echo "nixl wheels rc=$?"
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch; from kvserve.kv_connector.p2p.nixl_transport import nixl_import_error as e; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| nixl:', e() or 'ok')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s INT -k 5 70 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kv_connector/test_p2p_nixl.py \
  tests/kv_connector/test_p2p.py -k "nixl and not mp" > "$OUT/p2p_nixl_tests.txt" 2>&1
echo "p2p nixl tests rc=$?"; grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/p2p_nixl_tests.txt" | tail -12
for T in tcp nixl; do
  UCX_PROTO_INFO=y timeout 65 python3 benchmarks/pd_transfer.py --transport $T --out "$OUT" \
    > "$OUT/pd_log_$T.txt" 2>&1
  echo "pd_transfer $T rc=$?"; grep '^{' "$OUT/pd_log_$T.txt"; grep -E "Error|error" "$OUT/pd_log_$T.txt" | tail -3
done
echo "UCX transports of the NIXL READs:"
python3 benchmarks/pd_transfer.py --ucx-summary "$OUT/pd_log_nixl.txt"
