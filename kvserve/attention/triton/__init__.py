"""Triton attention kernels over the paged KV cache.

- ``store_kv`` (kv_store.py): scatter new K/V rows into their cache slots (cast on store).
- ``decode_attention`` (decode.py): query-length-1 requests, Flash-Decoding split-KV with
  GQA packing, plus a small split-combine kernel.
- ``prefill_attention`` (prefill.py): varlen causal prefill/extend over a paged prefix
  (FlashAttention-2 forward), GQA-packed.
- ``TritonBackend`` (backend.py): the ``"triton"`` attention backend using all three.

On a machine without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (set it before
importing this package); that is how the CPU tests exercise them at tiny shapes.
"""

from kvserve.attention.triton.backend import TritonBackend
from kvserve.attention.triton.decode import choose_num_splits, decode_attention
from kvserve.attention.triton.kv_store import store_kv
from kvserve.attention.triton.prefill import prefill_attention

__all__ = ["TritonBackend", "choose_num_splits", "decode_attention", "prefill_attention", "store_kv"]
