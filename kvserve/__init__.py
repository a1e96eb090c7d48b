"""kvserve: an LLM inference engine built around the KV cache."""

# Before torch loads: idle OpenMP threads sleep instead of spinning (kvserve.worker.cpu_threads).
from kvserve.worker.cpu_threads import set_passive_wait_policy

set_passive_wait_policy()

from kvserve.engine.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
