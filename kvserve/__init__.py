"""kvserve: an LLM inference engine built around the KV cache."""

# Before torch loads: idle OpenMP threads sleep instead of spinning (kvserve.worker.cpu_threads).
from kvserve.worker.cpu_threads import set_passive_wait_policy

set_passive_wait_policy()

import os  # noqa: E402

# Before the first CUDA allocation: expandable segments keep the caching allocator's reserved memory
# near what is allocated. On an H200 at max batch, fixed segments held 22 GiB beyond
# --gpu-memory-utilization 0.85 (reserved 138.8 GiB for 116.5 allocated); expandable: 118.7 of a
# 118.8 GiB budget (benchmarks/gpu_memory_stress.py). A user's PYTORCH_CUDA_ALLOC_CONF wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from kvserve.engine.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
