"""The decode kernel's FP8-dot path for e4m3 caches (``decode.DECODE_PATHS["fp8_dot"]``; Triton
interpreter on the CPU, tiny shapes): paged over random block tables, GQA, one split with sinks,
several with a sliding window, the keys as the MMAs' rows, Q K^T only (``fp8_pv`` False: V converted,
the query's rounding the only error), against the float64 reference over the dequantized cache
within the error bound derived in ``kvserve/attention/triton/decode.py`` (e4m3: 3 mantissa bits);
the path switch and its refusal of other caches."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.attention.kv_format import kv_format_for
from kvserve.attention.kv_quant import quantize_pages
from kvserve.attention.triton import decode_attention
from kvserve.attention.triton import decode_configs as dc
from kvserve.core.kv_cache_spec import get_kv_format
from tests.attention.paged_ref import random_block_tables

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must enable the interpreter"

U = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits), normals
SUB = 2.0 ** -10  # half of e4m3's subnormal step (2^-9): the absolute rounding error below 2^-6


def _layer(lens, h, hkv, d, bs, gen):
    """An e4m3 cache over random block tables; V rows of very different magnitudes (per-token scales
    over four decades), so the scales folded into the softmax matter."""
    bt, _, num_blocks = random_block_tables([(n - 1, 1) for n in lens], bs, gen)
    x = torch.randn(2, num_blocks, bs, hkv, d, generator=gen) * 2
    x[1] *= torch.exp(torch.randn(num_blocks, bs, hkv, 1, generator=gen) * 2)
    cache = quantize_pages(x, get_kv_format("fp8_e4m3"))
    return cache, bt


def _reference(q, cache, bt, lens, d, bs, scale, window=None, sinks=None):
    """Float64 attention over the dequantized pages, each query row exact and rounded to e4m3 as the
    kernel rounds it. Returns ``(exact, rounded_q, bound_exact, bound_rounded)`` ``[R, H, D]``: the
    bounds of ``decode.py``'s docstring (P V rounding against the rounded-query reference; plus the
    query's rounding against the exact one)."""
    fmt = kv_format_for("fp8_e4m3", d)
    deq = fmt.dequantize_pages(cache, torch.float64)
    _, scales = fmt.page_views(cache)
    h, hkv = q.shape[1], cache.shape[3]
    outs = ([], [], [], [])
    for i, n in enumerate(lens):
        blocks = bt[i, :-(-n // bs)].long()
        lo = 0 if window is None else max(0, n - window)
        k, v = (deq[j, blocks].reshape(-1, hkv, d)[lo:n].repeat_interleave(h // hkv, 1) for j in (0, 1))
        sv = scales[1, blocks].reshape(-1, hkv)[lo:n].double().repeat_interleave(h // hkv, 1).T  # [H, n]
        qf = q[i].double()
        qn = qf.abs().amax(-1, keepdim=True)
        q8 = (q[i].float() / q[i].float().abs().amax(-1, keepdim=True) * 448.0).to(torch.float8_e4m3fn).double()
        q8 = q8 * qn / 448.0
        res = []
        for qq in (qf, q8):
            s = torch.einsum("hd,nhd->hn", qq, k) * scale
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], 1)
            w = torch.softmax(s, -1)[:, :n - lo]
            res.append((w, torch.einsum("hn,nhd->hd", w, v)))
        (w, o), (w8, o8) = res
        p_bound = U * torch.einsum("hn,nhd->hd", w8, v.abs()) + SUB * (n - lo) * (w8 * sv).amax(-1, keepdim=True)
        dq = U * qf.abs() + SUB * qn / 448.0  # |q8 - q| per element
        delta = (torch.einsum("hd,nhd->hn", dq, k.abs()) * scale).amax(-1, keepdim=True)  # max logit change
        q_bound = torch.expm1(2 * delta) * torch.einsum("hn,nhd->hd", w, (v - o[None]).abs())
        for lst, t in zip(outs, (o, o8, q_bound + p_bound, p_bound)):
            lst.append(t)
    return tuple(torch.stack(t) for t in outs)


@pytest.mark.parametrize("q_dtype,splits,window,with_sinks,keys_rows,fp8_pv", [
    (torch.float32, 1, None, True, False, True),   # the direct path, sinks starting the running max
    (torch.bfloat16, 3, 20, False, False, True),   # three splits merged by the reduce kernel, a sliding window
    (torch.float32, 2, None, True, True, True),    # the keys as the MMAs' rows (FP8_T)
    (torch.float32, 1, None, True, False, False),  # Q K^T only on e4m3, V converted (FP8_PV False)
    (torch.bfloat16, 2, 20, False, True, False),   # the same with the keys as rows, splits and a window
])
def test_fp8_dot_within_e4m3_bound(q_dtype, splits, window, with_sinks, keys_rows, fp8_pv):
    h, hkv, d, bs = 8, 2, 32, 8  # GQA: 4 query heads per KV head
    lens = [37, 5, 64] if splits == 1 else [50, 23]
    gen = torch.Generator().manual_seed(11 + splits)
    cache, bt = _layer(lens, h, hkv, d, bs, gen)
    q = torch.randn(len(lens), h, d, generator=gen).to(q_dtype)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    scale = d ** -0.5
    fmt = kv_format_for("fp8_e4m3", d)
    out = torch.full_like(q, float("nan"), device=DEV)
    decode_attention(q.to(DEV), cache.to(DEV), bt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
                     torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV), len(lens), max(lens), scale,
                     window, out=out, num_splits=splits, kv_format=fmt,
                     sinks=None if sinks is None else sinks.to(DEV), fp8_dot=True, fp8_keys_rows=keys_rows,
                     fp8_pv=fp8_pv)
    got = out.double().cpu()
    exact, rounded, bound, p_bound = _reference(q, cache, bt, lens, d, bs, scale, window, sinks)
    slack = 1e-5 + (2.0 ** -8 * exact.abs() if q_dtype == torch.bfloat16 else 0)  # the output's own rounding
    if not fp8_pv:  # P V unrounded: float16 P on CUDA (2^-11 relative per term); only the query's bound
        slack = slack + 2.0 ** -5 * p_bound
        bound = bound - p_bound
        if q_dtype == torch.float32:  # (a bfloat16 query hits e4m3 ties: the interpreter rounds them up,
            # torch to even)
            assert ((got - rounded).abs() <= slack).all(), ((got - rounded).abs() / slack).max()
    assert ((got - rounded).abs() <= p_bound + slack).all(), ((got - rounded).abs() / p_bound).max()
    assert ((got - exact).abs() <= bound + slack).all(), ((got - exact).abs() / bound).max()
    # the path is taken: the conversion path is within ~1e-6 of the exact reference, this one is not
    assert (got - exact).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e5m2", "int8"])
def test_fp8_dot_refuses_other_caches(name):
    d, hkv = 32, 2
    desc = get_kv_format(name)
    fmt = kv_format_for(name, d)
    cache = torch.zeros(2, 3, 8, hkv, desc.row_elems(d), dtype=getattr(torch, desc.torch_dtype))
    q = torch.zeros(1, 4, d)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8_dot needs an fp8_e4m3 KV cache"):
        decode_attention(q, cache, torch.ones(1, 1, dtype=torch.int32), one, torch.tensor([0, 1], dtype=torch.int32),
                         1, 1, 1.0, kv_format=fmt if desc.quantized else None, fp8_dot=True)


def test_fp8_dot_switch_and_configs(monkeypatch):
    """The module switch (off: the conversion path) takes e4m3 caches only (others keep their path,
    no error); an FP8 MMA's K >= 32 on CUDA; its own tile table."""
    monkeypatch.setitem(dc.DECODE_PATHS, "fp8_dot", False)
    assert not dc.use_fp8_dot(1, 128, True) and dc.use_fp8_dot(1, 128, True, override=True)
    monkeypatch.setitem(dc.DECODE_PATHS, "fp8_dot", True)
    assert dc.use_fp8_dot(1, 128, True) and dc.use_fp8_dot(1, 16, False)
    assert not dc.use_fp8_dot(0, 128, True) and not dc.use_fp8_dot(2, 128, True)
    assert not dc.use_fp8_dot(1, 16, True) and not dc.use_fp8_dot(1, 128, True, plain=False)
    assert not dc.use_fp8_dot(1, 128, True, override=False)
    with pytest.raises(ValueError, match="head_size >= 32"):
        dc.use_fp8_dot(1, 16, True, override=True)
    for batch, bucket in ((1, "few"), (64, "mid"), (512, "many")):
        cfg = dc.decode_config(128, torch.bfloat16, False, 1, False, 0, batch, 8, 132, fp8_dot=True)
        assert cfg == dc.FP8_DOT_CONFIGS[bucket] and cfg.block_n >= 32
    assert dc.decode_config(256, torch.float32, False, 1, False, 0, 1, 8, 132, fp8_dot=True).block_n >= 32
    warm = dc.configs_to_compile(128, torch.bfloat16, False, 1, False, 0, 8, 132, fp8_dot=True)
    assert {c for c, _ in warm} == set(dc.FP8_DOT_CONFIGS.values())
    # Q K^T only (fp8_pv False) is a tile's choice: picked per bucket and warmed as its own variant
    qk_only = dc.DecodeConfig(64, 4, 5, fp8_keys_rows=True, fp8_pv=False)
    monkeypatch.setitem(dc.FP8_DOT_CONFIGS, "many", qk_only)
    assert dc.decode_config(128, torch.bfloat16, False, 1, False, 0, 512, 8, 132, fp8_dot=True) == qk_only
    warm = dc.configs_to_compile(128, torch.bfloat16, False, 1, False, 0, 8, 132, fp8_dot=True)
    assert qk_only in {c for c, _ in warm}
