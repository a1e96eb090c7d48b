"""Launch configs of the paged decode kernel (``decode.py``): the split rule and the config table.

``DECODE_CONFIGS`` maps ``(kv bytes per element, programs bucket)`` to a ``DecodeConfig`` (tile,
page-id gathering, split rule, fused reduce); ``decode_config`` picks a batch's entry (or
``_config``'s tile outside the table), ``decode_warmup_configs`` lists every config a layer can
get so the engine's warm-up compiles them all. The entries come from the ``decode-kernel`` GPU
part (``benchmarks/gpu_decode_kernel.py``; docs/benchmarks/decode-kernel.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from kvserve.attention.kv_format import KVCacheFormat
from kvserve.attention.triton.kv_load import kernel_cache_args, use_lane_split, use_unpack

_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132, block_n: int = 64,
    waves: int = 2, max_splits: int = 32,
) -> int:
    """Splits per request so that ~``waves`` waves of programs cover ``num_sms`` SMs.

    At most one split per ``block_n`` keys of the longest request, and at most ``max_splits``.
    (More splits for long requests, ~8 programs per SM, measured no faster on an H100 at batch
    64 x 8k: 0.77 ms vs 0.73 bf16; benchmarks/gpu_kv_quant.py times ``num_splits=1``.)
    """
    programs = max(1, num_reqs * num_kv_heads)
    want = triton.cdiv(waves * num_sms, programs)
    cap = max(1, triton.cdiv(max_seq_len, block_n))
    return max(1, min(want, cap, max_splits))


class DecodeConfig(NamedTuple):
    """One launch configuration of ``_decode_split_kernel``: the tile (``block_n`` keys per
    step, ``num_warps``, ``num_stages`` of software pipelining), ``page_tile`` (block-table
    entries read once per page of the tile, ``kv_tile_offsets``, instead of once per key), and
    the split rule (``choose_num_splits``'s ``waves`` and ``max_splits``); ``fuse_reduce``: with
    several splits, the last program of each (request, KV head) to finish merges the splits
    (an atomic count per pair), no reduce launch; ``fp8_keys_rows`` (the FP8-dot path only): the
    keys as the MMAs' rows (``decode_fp8._fp8_step_keys_rows``) instead of the query rows padded
    to 64; ``fp8_pv`` (the FP8-dot path only): P V an e4m3 dot too; False: Q K^T only on the e4m3
    codes, V converted to float16 and P V a float16 dot (prefill's ``fp8_qk`` alone); ``v_bytes``
    (8-bit codes, the conversion path): V's codes read from shared memory as bytes into the P V
    operand layout and converted there (``kv_load._code_rows``), no float16 copy of the tile."""

    block_n: int
    num_warps: int
    num_stages: int
    page_tile: bool = False
    waves: int = 2
    max_splits: int = 32
    fuse_reduce: bool = False
    fp8_keys_rows: bool = False
    fp8_pv: bool = True
    v_bytes: bool = False


#: Decode configs on CUDA for head_dim <= 128, 16-bit queries and plain 16-bit or 8-bit KV,
#: keyed by ``(kv bytes per element, programs bucket)``; the bucket compares the
#: (request, KV head) programs with the SM count (``programs_bucket``): "few" (< SMs: the keys
#: are split), "mid" (< 8 x SMs, e.g. batch 64 x 8 KV heads), "many" (batch 512). Under CUDA
#: graphs the batch is the captured size, so each graph has one config. Chosen from the
#: ``decode-kernel`` sweep (benchmarks/gpu_decode_kernel.py; docs/benchmarks/decode-kernel.md).
#: Measured on an H200 (2026-11-28, Llama-3.1-8B attention shape): bf16 512 x 2K and 64 x 8K at 1.03x
#: the copy rate with 64x2x4 (64x4x2: 0.99x-1.02x); 1 x 32K 0.73x with 128 keys, 8 warps and page
#: tiles (64x4x2: 0.60x); fp8 0.69x at 512 x 2K and 64 x 8K, 0.41x at 1 x 32K with every tile tried
#: (the e4m3 -> fp16 conversion through shared memory bounds it).
DECODE_CONFIGS: dict[tuple[int, str], DecodeConfig] = {
    (2, "few"): DecodeConfig(128, 8, 2, page_tile=True),
    (2, "mid"): DecodeConfig(64, 2, 4),
    (2, "many"): DecodeConfig(64, 2, 4),
    (1, "few"): DecodeConfig(64, 2, 5),
    (1, "mid"): DecodeConfig(64, 2, 5),
    (1, "many"): DecodeConfig(64, 2, 5),
}


#: Defaults of the decode kernel's optional paths, read at each launch (a module dict so a benchmark
#: can switch them for a whole engine run; ``decode_attention``'s arguments override): ``fp8_dot``:
#: e4m3 caches compute Q K^T and P V as FP8 tensor-core dots on the codes as stored (the query and
#: P rounded to e4m3, the per-token scales folded into the scores and the softmax; error bound in
#: ``decode.py``), instead of converting the codes to float16. Off until the GPU sweep decides
#: (``decode-kernel`` part, docs/benchmarks/decode-kernel.md). Whether P V is an e4m3 dot too is the
#: tile's (``DecodeConfig.fp8_pv`` in ``FP8_DOT_CONFIGS``).
DECODE_PATHS = {"fp8_dot": False}

#: ``DECODE_CONFIGS``' tiles for the FP8-dot path of e4m3 caches, by programs bucket (head_dim
#: <= 128 on CUDA). Triton (3.7, sm_90) emits e4m3 ``wgmma`` for both dots with 4+ warps and 64
#: MMA rows (with 2 warps it takes ``mma.sync``, which on sm_90 converts FP8 operands to float16
#: first): either the keys are the rows (``fp8_keys_rows``, ``BLOCK_N`` >= 64; the softmax over
#: the GROUP query rows padded to 16) or the query rows, padded to 64 (4x the softmax work). Not yet
#: measured: keys as rows, 64 x 4 warps x 3 stages (167 registers per thread, no spills, in the
#: sm_90 PTX: ``benchmarks/ptx_kv_loads.py --fp8-dot --regs``); the GPU sweep decides.
FP8_DOT_CONFIGS: dict[str, DecodeConfig] = {
    "few": DecodeConfig(64, 4, 3, fp8_keys_rows=True),
    "mid": DecodeConfig(64, 4, 3, fp8_keys_rows=True),
    "many": DecodeConfig(64, 4, 3, fp8_keys_rows=True),
}


def use_fp8_dot(kv_fmt: int, head_dim: int, on_cuda: bool, override: bool | None = None,
                plain: bool = True) -> bool:
    """Whether a launch takes the FP8-dot path: asked for (``override``, else ``DECODE_PATHS``) and
    possible: e4m3 codes (``KV_FMT`` 1), ``plain`` (no in-kernel rotation, no exact own block) and,
    on CUDA, ``head_dim >= 32`` (an FP8 MMA's K). The module default applies where it can; an
    explicit ``override=True`` that cannot apply raises ValueError."""
    want = DECODE_PATHS["fp8_dot"] if override is None else bool(override)
    possible = kv_fmt == 1 and plain and (head_dim >= 32 or not on_cuda)
    if want and override and not possible:
        raise ValueError(f"fp8_dot needs an fp8_e4m3 KV cache (got kernel code {kv_fmt}), no rotation or exact "
                         f"own blocks (plain={plain}) and on CUDA head_size >= 32 (got {head_dim})")
    return bool(want and possible)


def programs_bucket(num_decodes: int, num_kv_heads: int, num_sms: int) -> str:
    """``DECODE_CONFIGS``' programs bucket of a batch: "few", "mid" or "many"."""
    programs = num_decodes * num_kv_heads
    return "few" if programs < num_sms else ("mid" if programs < 8 * num_sms else "many")


def decode_config(head_dim: int, dtype: torch.dtype, interpret: bool, kv_fmt: int, lane_split: bool,
                  unpack: int, num_decodes: int, num_kv_heads: int, num_sms: int,
                  fp8_dot: bool = False) -> DecodeConfig:
    """The launch config of a batch: ``DECODE_CONFIGS`` where it applies (``FP8_DOT_CONFIGS`` on the
    FP8-dot path), else ``_config``'s tile with the default split rule."""
    bucket = programs_bucket(num_decodes, num_kv_heads, num_sms)
    if fp8_dot and not interpret:  # FP8 operands: any query dtype; BLOCK_N >= 32 (the P V dot's K)
        return FP8_DOT_CONFIGS[bucket] if head_dim <= 128 else DecodeConfig(32, 4, 2)
    if not interpret and head_dim <= 128 and dtype != torch.float32 and kv_fmt <= 3:
        return DECODE_CONFIGS[(1 if kv_fmt else 2, bucket)]
    return DecodeConfig(*_config(head_dim, dtype, interpret, kv_fmt, lane_split, unpack, bucket == "few"))


def decode_warmup_configs(query: torch.Tensor, kv_cache: torch.Tensor,
                          kv_format: KVCacheFormat | None) -> list[tuple[DecodeConfig, tuple[int, ...]]]:
    """Every distinct config ``decode_attention`` can pick for this layer (query ``[T, H, D]``,
    cache and format as it takes them), each with one split count per compiled variant (1 only
    when it never splits): the engine's warm-up compiles those, so no batch size compiles
    mid-serving."""
    d, hkv = query.shape[2], kv_cache.shape[3]
    _, kv_fmt = kernel_cache_args(kv_cache, kv_format)
    interpret = query.device.type != "cuda"
    lane_split = use_lane_split(kv_fmt, d)
    unpack = use_unpack(kv_fmt, not interpret, query.dtype != torch.float32) if lane_split else 0
    fp8_dot = use_fp8_dot(kv_fmt, d, not interpret)
    return configs_to_compile(d, query.dtype, interpret, kv_fmt, lane_split, unpack, hkv, _num_sms(query.device),
                              fp8_dot)


def configs_to_compile(head_dim: int, dtype: torch.dtype, interpret: bool, kv_fmt: int, lane_split: bool,
                       unpack: int, num_kv_heads: int, num_sms: int,
                       fp8_dot: bool = False) -> list[tuple[DecodeConfig, tuple[int, ...]]]:
    """``decode_warmup_configs`` from ``decode_config``'s arguments."""
    seen: dict[DecodeConfig, bool] = {}
    for programs in (1, num_sms, 8 * num_sms):  # the smallest batch of each bucket
        cfg = decode_config(head_dim, dtype, interpret, kv_fmt, lane_split, unpack,
                            triton.cdiv(programs, num_kv_heads), num_kv_heads, num_sms, fp8_dot)
        seen[cfg] = seen.get(cfg, False) or cfg.waves * num_sms > programs  # choose_num_splits may split
    # one split count per compiled class: the direct path, then S_PAD 2, 4, .. of the reduce kernel
    # (a fused reduce: one split variant)
    def counts(cfg: DecodeConfig) -> tuple[int, ...]:
        return (1, 2) if cfg.fuse_reduce else (1, *(2 ** k + 1 for k in range(max(1, cfg.max_splits - 1).bit_length())))

    return [(cfg, counts(cfg) if split else (1,)) for cfg, split in seen.items()]


def _config(head_dim: int, dtype: torch.dtype, interpret: bool, kv_fmt: int = 0,
            lane_split: bool = False, unpack: int = 0, few_programs: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). ``few_programs``: fewer (request, KV head) programs
    than SMs, so the keys are split into more, shorter slices (``choose_num_splits``)."""
    if interpret:
        return 16, 1, 1
    if dtype == torch.float32:  # fp32 operands ("ieee" FMA dot): small tiles avoid spills
        return 16, 4, 2
    if head_dim >= 256:
        return 32, 4, 2
    # Quantized tiles, from the H100 sweep (benchmarks/gpu_kv_quant.py, batch 64 x 8k, head dim
    # 128, folded scales; bf16 0.714 ms at 64 x 4 x 2): 8-bit codes 64 keys x 4 warps x 2
    # stages (fp8 0.460 ms, int8 0.548; 32 x 4 x 3: 0.604 / 0.670), int4/int2 32 x 4 x 2
    # (0.745 / 0.743; 64 x 4 x 2: 0.900 / 0.913). Re-check after kernel changes
    # (registers per config: benchmarks/ptx_kv_loads.py --regs). One dot per bit lane
    # (gpu_kv_quant.py --code-paths, same shape): int4 128 x 4 x 2 0.465 ms (64 x 4 x 2
    # 0.467, 32 x 4 x 2 0.593), int2 0.374 (0.447, 0.540).
    # Deeper pipelines with 2 warps (a sweep with --configs of the same benchmark): fp8
    # 64 x 2 x 5 0.404 ms (2.70 TB/s, 0.90 of the roofline; 64 x 4 x 2 0.461), int8 0.534
    # (0.544), int4 0.391 (0.471); int2 stays at 128 x 4 x 2 (0.373; 64 x 2 x 5 0.386).
    # 7+ stages or 4 warps at 5 stages were slower (benchmarks/results/kv_quant/h100_dtypes/).
    # Bit lanes built by inline PTX (UNPACK 1) use fewer registers: 128 x 2 x 5 for both, int4
    # 0.326 ms (64 x 2 x 5 0.358, 128 x 4 x 2 0.470), int2 0.248 (128 x 4 x 2 0.275, 64 x 2 x 5
    # 0.306) (benchmarks/results/kv_quant/h100_unpack/). With few programs (batch 1) 128-key
    # tiles halve the splits (8 for 1k keys): batch-1 decode was +4.1% over bf16, so 64 there.
    if kv_fmt >= 4:
        if not lane_split:
            return 32, 4, 2
        if unpack:
            return (64, 2, 5) if few_programs else (128, 2, 5)
        return (64, 2, 5) if kv_fmt == 4 else (128, 4, 2)
    if kv_fmt > 0:
        return 64, 2, 5
    return 64, 4, 2
