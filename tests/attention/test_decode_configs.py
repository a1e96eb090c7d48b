"""The decode kernel's launch configs: page ids gathered once per tile (``page_tile``) and the
reduce fused into the split kernel (``fuse_reduce``) for every KV dtype, split and unsplit,
against a float64 reference over the cache; the config table and the warm-up's variants."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.attention.forward_context import AttentionMetadata
from kvserve.attention.kv_format import kv_format_for
from kvserve.attention.kv_quant import quantize_pages
from kvserve.attention.triton import decode_attention
from kvserve.attention.triton import decode_configs as cfgs
from kvserve.attention.triton.decode import _COUNTERS
from kvserve.core.kv_cache_spec import get_kv_format
from tests.attention.paged_ref import random_block_tables

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"


def _decode_batch(ctx_lens, bs, h, hkv, d, name, gen):
    """Ragged decodes (``ctx_lens`` keys each, the new one included) over random, non-contiguous
    pages of random values (quantized formats: random pages); ``(q, cache, meta)``."""
    reqs = [(c - 1, 1) for c in ctx_lens]
    bt, _, num_blocks = random_block_tables(reqs, bs, gen)
    x = torch.randn(2, num_blocks, bs, hkv, d, generator=gen)
    fmt = get_kv_format(name)
    cache = quantize_pages(x, fmt) if fmt.quantized else x.to(getattr(torch, fmt.torch_dtype))
    slens = list(ctx_lens)
    n = len(ctx_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=DEV), block_tables=bt.to(DEV),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=DEV), query_lens_cpu=[1] * n, seq_lens_cpu=slens,
        max_query_len=1, max_seq_len=max(slens), num_decodes=n)
    return torch.randn(n, h, d, generator=gen).to(DEV), cache.to(DEV), meta


# (KV dtype, block size, BLOCK_N, splits): BLOCK_N > block size gathers several pages per tile,
# BLOCK_N < block size one page from a slot offset; 1 split writes the output directly
CASES = [
    ("float32", 4, 16, 1),
    ("bfloat16", 32, 16, 3),
    ("fp8_e4m3", 4, 16, 3),
    ("fp8_e5m2", 32, 16, 1),
    ("int8", 8, 32, 2),
    ("int4", 4, 32, 1),
    ("int2", 8, 16, 3),
]


def _dense_ref(q, cache, meta, name, d, window=None):
    """float64 attention of each decode row over its request's keys as the cache holds them
    (dequantized pages), the newest ``window`` only if given."""
    fmt = kv_format_for(name, d)
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    h, hkv = q.shape[1], cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, s in enumerate(meta.seq_lens_cpu):
        pages = raw[:, meta.block_tables[i].long()].view(cache.dtype).cpu()
        kv = fmt.dequantize_pages(pages, torch.float32).flatten(1, 2)[:, :s].double()  # [2, s, hkv, d]
        lo = 0 if window is None else max(0, s - window)
        k, v = (t[lo:].repeat_interleave(h // hkv, 1).transpose(0, 1) for t in kv)  # [h, n, d]
        p = ((q[i].cpu().double()[:, None, :] @ k.transpose(1, 2)) * d ** -0.5).softmax(-1)
        out[i] = (p @ v)[:, 0]
    return out


@pytest.mark.parametrize("name,bs,block_n,splits", CASES)
def test_page_tile_decode_matches_reference(name, bs, block_n, splits):
    """Several splits also merge inside the split kernel (``fuse_reduce``), twice: the counts
    were set back to 0 by the first launch."""
    gen = torch.Generator().manual_seed(7)
    h, hkv, d = 4, 2, 32
    q, cache, meta = _decode_batch([block_n + 4, 2 * bs], bs, h, hkv, d, name, gen)
    fmt = kv_format_for(name, d) if get_kv_format(name).quantized else None
    ref = _dense_ref(q, cache, meta, name, d)
    for fuse in ((False, True, True) if splits > 1 else (False,)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                         meta.max_seq_len, d ** -0.5, out=out, num_splits=splits, block_n=block_n, page_tile=True,
                         fuse_reduce=fuse, kv_format=fmt)
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)
    assert not _COUNTERS or not _COUNTERS[q.device].any()


def test_fused_reduce_with_sinks_equals_the_reduce_kernel():
    """17 splits: the merge reads them in two chunks of 16, most of them empty."""
    gen = torch.Generator().manual_seed(5)
    d = 32
    q, cache, meta = _decode_batch([50, 3], 16, 4, 1, d, "bfloat16", gen)
    sinks = torch.randn(4, generator=gen).to(DEV)
    outs = []
    for fuse in (False, True):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                         meta.max_seq_len, d ** -0.5, out=out, num_splits=17, sinks=sinks, fuse_reduce=fuse)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_page_tile_equals_per_key_offsets_with_a_window():
    """Same keys, same order, same math: the two ways of reading the block table agree bit for
    bit (a sliding window whose first key is inside a tile, several pages per tile)."""
    gen = torch.Generator().manual_seed(3)
    d, window = 32, 21
    q, cache, meta = _decode_batch([40, 7], 8, 4, 2, d, "fp8_e4m3", gen)
    fmt = kv_format_for("fp8_e4m3", d)
    outs = []
    for page_tile in (False, True):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                         meta.max_seq_len, d ** -0.5, window, out=out, num_splits=2, block_n=32, page_tile=page_tile,
                         kv_format=fmt)
        outs.append(out)
    torch.testing.assert_close(outs[1].cpu().double(), _dense_ref(q, cache, meta, "fp8_e4m3", d, window),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_config_table_buckets_and_split_rule():
    assert cfgs.programs_bucket(1, 8, 132) == "few"
    assert cfgs.programs_bucket(64, 8, 132) == "mid"
    assert cfgs.programs_bucket(512, 8, 132) == "many"
    bf16, fp8 = torch.bfloat16, 1
    for nd, bucket in ((1, "few"), (64, "mid"), (512, "many")):
        assert cfgs.decode_config(128, bf16, False, 0, False, 0, nd, 8, 132) == cfgs.DECODE_CONFIGS[(2, bucket)]
        assert cfgs.decode_config(128, bf16, False, fp8, False, 0, nd, 8, 132) == cfgs.DECODE_CONFIGS[(1, bucket)]
    # outside the table (interpreter, float32, head dim 256, 4-bit codes): _config's tile, the default rule
    assert cfgs.decode_config(128, bf16, True, 0, False, 0, 1, 8, 132) == cfgs.DecodeConfig(16, 1, 1)
    assert cfgs.decode_config(256, bf16, False, 0, False, 0, 1, 8, 132) == cfgs.DecodeConfig(32, 4, 2)
    # the split rule: ~waves x SMs programs, capped by keys / BLOCK_N and max_splits
    assert cfgs.choose_num_splits(1, 8, 32768, 132, 64) == 32
    assert cfgs.choose_num_splits(1, 8, 32768, 132, 64, waves=4, max_splits=128) == 66
    assert cfgs.choose_num_splits(64, 8, 8192, 132, 64, waves=8) == 3
    assert cfgs.choose_num_splits(512, 8, 2048, 132, 64, waves=8) == 1


def test_warmup_compiles_every_config_the_table_can_pick(monkeypatch):
    """Each distinct config appears once, with the split counts of every reduce-kernel variant
    it can reach (S_PAD 2 .. next_pow2(max_splits)) or only the direct path."""
    table = dict(cfgs.DECODE_CONFIGS)
    table[(2, "few")] = cfgs.DecodeConfig(64, 4, 2, True, 4, 64)
    table[(1, "few")] = cfgs.DecodeConfig(64, 2, 5, True, 4, 64, True)
    table[(2, "mid")] = cfgs.DecodeConfig(128, 4, 2, False, 1)  # never splits at >= SMs programs
    table[(2, "many")] = cfgs.DecodeConfig(128, 4, 2, False, 1)
    monkeypatch.setattr(cfgs, "DECODE_CONFIGS", table)
    got = cfgs.configs_to_compile(128, torch.bfloat16, False, 0, False, 0, 8, 132)
    assert got == [(cfgs.DecodeConfig(64, 4, 2, True, 4, 64), (1, 2, 3, 5, 9, 17, 33)),
                   (cfgs.DecodeConfig(128, 4, 2, False, 1), (1,))]
    got = cfgs.configs_to_compile(128, torch.bfloat16, False, 1, False, 0, 8, 132)  # fused: no reduce kernel
    assert got[0] == (cfgs.DecodeConfig(64, 2, 5, True, 4, 64, True), (1, 2))
    # the shipped table, on the interpreter: one config (_config's), every variant
    q = torch.zeros(1, 4, 32)
    assert cfgs.decode_warmup_configs(q, torch.zeros(2, 1, 16, 2, 32), None) == [
        (cfgs.DecodeConfig(16, 1, 1), (1, 2, 3, 5, 9, 17))]
