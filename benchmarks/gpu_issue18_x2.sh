#!/usr/bin/env bash
# Issue 18 on two GPUs (`nvidia-h200-x2`): 1 prefill + 1 decode worker (NIXL over the GPUs'
# link) vs 2 colocated replicas, behind `kvserve router`, same mixed workload
# (benchmarks/pd_goodput.py), plus the link's ceilings and how the GPUs are connected.
# Wheels the GPU machine lacks: the server's in .whl/ (fastapi, starlette, pydantic(-core),
# annotated-types, typing-inspection, uvicorn, pyzmq, msgspec, and opentelemetry-api/-sdk/
# -semantic-conventions + importlib-metadata, which fastapi 0.165 imports: cp312) and NIXL in
# .whl_nixl/ (the `nixl` meta wheel + nixl_trim.tar.xz: nixl-cu13 1.5.1's wheel unpacked without
# its nixl_ep_cu13 extension and UCX's perftest library, so that it fits a call's 64 MiB). Made with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl <the packages above>
#   pip download ... -d /tmp nixl-cu13==1.5.1 nixl==1.5.1 (the meta wheel goes to .whl_nixl/), then
#   unzip the nixl-cu13 wheel into a folder, rm -r nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest_cuda.so*,
#   tar -C folder -cJf .whl_nixl/nixl_trim.tar.xz .
# Usage (repo root): OUT=<dir> bash benchmarks/gpu_issue18_x2.sh   (about 9 minutes)
set -u
OUT=${OUT:-/tmp/kvserve-out}
mkdir -p "$OUT"
T0=$(date +%s)
SITE=/tmp/site
mkdir -p $SITE
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl > "$OUT/wheels.txt" 2>&1
  echo "server wheels rc=$?"
fi
if [ -f .whl_nixl/nixl_trim.tar.xz ]; then
  tar -C $SITE -xJf .whl_nixl/nixl_trim.tar.xz && \
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl_nixl/nixl-*-py3-none-any.whl \
    >> "$OUT/wheels.txt" 2>&1
  echo "nixl rc=$?"
fi
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVSERVE_COMMIT=${KVSERVE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
echo "setup $(( $(date +%s) - T0 ))s"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -8
python3 -c "import torch, triton, fastapi, zmq, msgspec; from kvserve.kv_connector.p2p.nixl_transport import nixl_import_error as e; \
print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), '| nixl:', e() or 'ok')"
# NIXL READ of 64 MiB x 2 layers x K/V from GPU 1's memory into GPU 0's (two processes)
UCX_PROTO_INFO=y timeout -k 5 60 python3 benchmarks/nixl_probe.py --device cuda:0 --producer-device cuda:1 \
  > "$OUT/nixl_probe_x2.txt" 2>&1
grep -E "nixl probe|Error" "$OUT/nixl_probe_x2.txt"; python3 benchmarks/pd_transfer.py --ucx-summary "$OUT/nixl_probe_x2.txt" | head -3
# UCX_PROTO_INFO=y: every worker logs the transports UCX picked (CUDA IPC over NVLink expected)
UCX_PROTO_INFO=y timeout -k 10 $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/pd_goodput.py --out /tmp/pdg \
  --deadline $(( 560 - ($(date +%s) - T0) )) ${PDG_ARGS:-} 2>&1 | tee "$OUT/pd_goodput_log.txt" | grep -v '^{"mode'
cp /tmp/pdg/pd_goodput.json "$OUT/" 2>/dev/null
python3 benchmarks/pd_transfer.py --ucx-summary /tmp/pdg/workers_pd/decode0.log > "$OUT/ucx_summary.txt" 2>&1
head -5 "$OUT/ucx_summary.txt"
tar -C /tmp/pdg -czf "$OUT/pd_goodput_all.tar.gz" . && ls -la "$OUT"
echo "total $(( $(date +%s) - T0 ))s"
