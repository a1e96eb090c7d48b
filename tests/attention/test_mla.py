"""MLA's latent KV format and attention: spec bytes, store / gather / copy-on-write of latent
rows, the absorbed decode against the expanded per-head attention, and the Triton MLA decode
kernel (split-K over paged rows) against the torch path under the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.kv_format import KVCacheView, MLALatentFormat, format_of_spec
from kvserve.attention.metadata import metadata_from_arrays
from kvserve.attention.mla import MLAAttentionImpl, absorbed_weights, mla_decode_torch
from kvserve.core.kv_cache_spec import MLAAttentionSpec, latent_format_name

L, R, H, NOPE, V, BS = 32, 8, 4, 16, 16, 4
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel's device (interpreter on the CPU)


def _spec(dtype="mla_float32", **kw) -> MLAAttentionSpec:
    return MLAAttentionSpec(BS, 1, L + R, dtype, "float32", kv_lora_rank=L, qk_rope_head_dim=R, num_heads=H,
                            qk_nope_head_dim=NOPE, v_head_dim=V, **kw)


def test_spec_bytes_and_reference():
    spec = _spec()
    assert spec.bytes_per_token == (L + R) * 4  # one row, no V half, no heads
    assert spec.page_size_bytes == BS * (L + R) * 4
    assert spec.reference_bytes_per_token("float32") == H * (NOPE + R + V) * 4
    assert _spec("mla_bfloat16").bytes_per_token == (L + R) * 2
    assert _spec(tp_size=2).reference_bytes_per_token("bfloat16") == H // 2 * (NOPE + R + V) * 2
    assert "latent replicated on 2 ranks" in _spec(tp_size=2).type_name
    assert latent_format_name("bfloat16") == "mla_bfloat16"
    for bad in ("fp8_e5m2", "int8", "int4"):
        with pytest.raises(ValueError, match="latent"):
            latent_format_name(bad)
    assert isinstance(format_of_spec(spec), MLALatentFormat)


def test_latent_store_gather_copy():
    fmt = format_of_spec(_spec())
    cache = torch.zeros(fmt.cache_shape(6, BS, 1))
    assert cache.shape == (1, 6, BS, 1, L + R)
    rows = torch.randn(5, L + R)
    slots = torch.tensor([4, 5, -1, 9, 23])
    fmt.store(rows, None, cache, slots)
    flat = cache[0].view(-1, L + R)
    torch.testing.assert_close(flat[[4, 5, 9, 23]], rows[[0, 1, 3, 4]])
    got, none = fmt.gather(cache, torch.tensor([[1, 2], [5, 0]]), 2)
    assert none is None and got.shape == (2, 2 * BS, 1, L + R)
    torch.testing.assert_close(got[0, :2, 0], rows[:2])
    fmt.copy_slots(cache, torch.tensor([4, 5]), torch.tensor([12, 13]))
    torch.testing.assert_close(flat[[12, 13]], rows[:2])


def _paged(seq_lens, num_blocks=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(1, num_blocks, BS, 1, L + R, generator=g).to(dtype)
    width = max(-(-s // BS) for s in seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // BS)
        tables[i, :n] = perm[used:used + n].int()
        used += n
    return cache, tables


@pytest.mark.parametrize("triton_decode", [False, True])
def test_absorbed_decode_equals_expanded_attention(triton_decode):
    """The decode path (W_UK into the query, W_UV into the output, attention over the rows;
    torch or the Triton kernel) equals attention over the heads expanded by kv_b_proj."""
    g = torch.Generator().manual_seed(1)
    seq_lens = [1, 6, 13]
    cache, tables = _paged(seq_lens)
    w = torch.randn(H * (NOPE + V), L, generator=g) * 0.2
    q_nope, q_pe = torch.randn(3, H, NOPE, generator=g), torch.randn(3, H, R, generator=g)
    new_rows = torch.randn(3, L + R, generator=g)
    slots = np.array([int(tables[i, (s - 1) // BS]) * BS + (s - 1) % BS for i, s in enumerate(seq_lens)])
    ql = np.ones(3, dtype=np.int64)
    dev = torch.device(DEV if triton_decode else "cpu")
    meta = metadata_from_arrays(ql, np.array(seq_lens), np.arange(4), [tables.numpy()], [slots], 3, dev)[0]
    dcache = cache.to(dev)
    view = KVCacheView.bind(dcache, format_of_spec(_spec()))
    out = MLAAttentionImpl(triton_decode).forward(q_nope.to(dev), q_pe.to(dev), new_rows.to(dev), w.to(dev), view, meta,
                                                  0.3, V, torch.zeros(3, H * V, device=dev)).cpu()
    cache = dcache.cpu()
    w_uk, w_uv = absorbed_weights(w, H, NOPE, V)
    for i, s in enumerate(seq_lens):
        rows = cache[0, tables[i, : -(-s // BS)].long()].reshape(-1, L + R)[:s]
        torch.testing.assert_close(rows[-1], new_rows[i])
        k_nope = torch.einsum("hdl,sl->hsd", w_uk, rows[:, :L])
        k = torch.cat([k_nope, rows[None, :, L:].expand(H, s, R)], dim=-1)
        v = torch.einsum("hdl,sl->hsd", w_uv, rows[:, :L])
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1)[:, None]
        ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)[:, 0].reshape(-1)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_mla_decode_matches_torch(num_splits):
    from kvserve.attention.triton.mla_decode import mla_decode

    seq_lens = [1, 7, 13, 40]
    cache, tables = _paged(seq_lens, num_blocks=40)
    q = torch.randn(len(seq_lens), H, L + R, generator=torch.Generator().manual_seed(2))
    ref = mla_decode_torch(q, cache, tables, seq_lens, L, 0.25)
    got = mla_decode(q.to(DEV), cache.to(DEV), tables.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), L,
                     0.25, max(seq_lens), num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,block_h,block_v,swap,num_splits,f16", [
    (1, 16, 32, False, 1, False),  # one head, padded to the MMA's 16
    (4, 16, 32, True, 3, True),  # K q^T orientation; FP8 rows as fp16
    (17, 16, 16, False, 1, True),  # two head blocks x two column blocks
    (4, 16, 16, True, 5, False),  # swapped + column blocks; splits past the end of the shorter requests
])
def test_triton_mla_decode_tiles(fp8, heads, block_h, block_v, swap, num_splits, f16):
    """Every tile variant of the split kernel against the torch path, bf16-as-fp32 and FP8
    latent rows; block-table entries past each request's length are garbage ids that must
    never be read."""
    from kvserve.attention.triton.mla_decode import MLADecodeConfig, mla_decode

    seq_lens = [1, 7, 13, 40]
    cache, tables = _paged(seq_lens, num_blocks=40, seed=heads)
    fmt = format_of_spec(_spec("mla_fp8_e4m3")) if fp8 else None
    if fp8:
        cache = fmt.encode(cache)
    q = torch.randn(len(seq_lens), heads, L + R, generator=torch.Generator().manual_seed(5))
    if f16:
        q[0, 0] *= 1e5  # past fp16's range: the per-head divisor must keep it
    ref = mla_decode_torch(q, cache, tables, seq_lens, L, 0.25, fmt)
    holes = tables.clone()
    for i, s in enumerate(seq_lens):
        holes[i, -(-s // BS):] = 1 << 20  # out of the cache: a read would fault or differ
    cfg = MLADecodeConfig(block_h=block_h, block_n=16, block_v=block_v, num_warps=4, num_stages=1, swap=swap, f16=f16)
    got = mla_decode(q.to(DEV), cache.to(DEV), holes.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
                     L, 0.25, max(seq_lens), num_splits=num_splits, fp8=fp8, config=cfg)
    tol = 2e-3 if fp8 and f16 else 1e-4  # fp16 query and p (f16 only applies to FP8 rows)
    torch.testing.assert_close(got.cpu(), ref, atol=tol, rtol=tol)


def test_mla_decode_splits_and_configs():
    """Split count: full waves for the batch x programs, no split under min_chunk positions;
    the table covers every (heads, dtype) it is asked for; a bad column block is refused."""
    from kvserve.attention.triton.mla_decode import MLADecodeConfig, choose_num_splits, decode_config, mla_decode

    cpu = torch.device("cpu")  # 4 "SMs"
    assert choose_num_splits(64, 1, 8192, cpu) == 1  # 64 programs already fill 2 waves of 4
    assert choose_num_splits(1, 1, 8192, cpu) == 8
    assert choose_num_splits(1, 1, 300, cpu) == 2  # min_chunk 256
    assert choose_num_splits(3, 1, 8192, cpu, ctas_per_sm=2) == 8  # 24 programs = 3 full waves of 8
    assert choose_num_splits(5, 2, 10, cpu) == 1
    for h in (1, 16, 20, 64, 128, 256):
        for fp8 in (False, True):
            assert decode_config(h, fp8, torch.device("cuda")).block_h >= 16
    q = torch.zeros(1, 2, L + R)
    cache, tables = _paged([4])
    with pytest.raises(ValueError, match="block_v"):
        mla_decode(q, cache, tables, torch.tensor([4], dtype=torch.int32), L, 0.25, 4,
                   config=MLADecodeConfig(16, 16, block_v=24))


def test_plan_kv_mla_rows():
    """DeepSeek-V2-Lite's shape: 576 latent values per token and layer vs 16 x (128 + 64 + 128) expanded."""
    from kvserve.core.kv_capacity import plan_kv_mla

    rows = plan_kv_mla(27, 512, 64, 16, 128, 128, 2**30, 32768, 16, ["bfloat16"], "bfloat16")
    assert [r.kv_cache_dtype for r in rows] == ["mla_bfloat16", "mha_expanded_bfloat16"]
    assert rows[0].bytes_per_token == 576 * 2 * 27 and rows[1].bytes_per_token == 16 * 320 * 2 * 27
    assert rows[0].vs_reference == pytest.approx(16 * 320 / 576, rel=1e-2)  # whole blocks
    with pytest.raises(ValueError, match="latent"):
        plan_kv_mla(27, 512, 64, 16, 128, 128, 2**30, 32768, 16, ["int4"])


def test_fp8_latent_rows_and_kernel():
    """mla_fp8_e4m3: encode/decode within e4m3's relative step; the Triton kernel reads the
    codes and scales as the torch path does."""
    from kvserve.attention.triton.mla_decode import mla_decode

    fmt = format_of_spec(_spec("mla_fp8_e4m3"))
    assert fmt.row_elems == 48 and fmt.storage_dtype == torch.uint8
    x = torch.randn(10, L + R) * 3
    back = fmt.decode(fmt.encode(x), torch.float32)
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 448 * 16 + 1e-6).all()  # 1/16 relative steps
    seq_lens = [3, 9, 22]
    plain, tables = _paged(seq_lens, num_blocks=20)
    cache = fmt.encode(plain)
    q = torch.randn(3, H, L + R, generator=torch.Generator().manual_seed(4))
    ref = mla_decode_torch(q, cache, tables, seq_lens, L, 0.25, fmt)
    got = mla_decode(q.to(DEV), cache.to(DEV), tables.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), L,
                     0.25, 22, num_splits=2, block_n=16, fp8=True)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    exact = mla_decode_torch(q, plain, tables, seq_lens, L, 0.25)
    assert (ref - exact).abs().max() < 0.1


def test_uniform_query_verify_rows_as_absorbed_decodes():
    """A verify-shaped step (every request 3 query tokens) through the per-token absorbed
    decode (Triton kernel; device lengths only, as CUDA graphs capture it) equals the
    expanded causal path that reads the host lengths."""
    from kvserve.attention.mla import per_token_decode_inputs, uniform_query_len

    g = torch.Generator().manual_seed(2)
    q, seq_lens = 3, [5, 11]
    n = q * len(seq_lens)
    w = torch.randn(H * (NOPE + V), L, generator=g) * 0.2
    q_nope, q_pe = torch.randn(n, H, NOPE, generator=g), torch.randn(n, H, R, generator=g)
    new_rows = torch.randn(n, L + R, generator=g)
    outs = []
    for triton in (False, True):
        cache, tables = _paged(seq_lens)
        slots = np.array([int(tables[i, p // BS]) * BS + p % BS for i, s in enumerate(seq_lens)
                          for p in range(s - q, s)])
        ql = np.full(2, q, dtype=np.int64)
        dev = torch.device(DEV if triton else "cpu")
        meta = metadata_from_arrays(ql, np.array(seq_lens), np.arange(0, n + 1, q), [tables.numpy()], [slots], 0,
                                    dev)[0]
        assert uniform_query_len(meta, n) == q and uniform_query_len(meta, n - 1) is None
        view = KVCacheView.bind(cache.to(dev), format_of_spec(_spec()))
        outs.append(MLAAttentionImpl(triton).forward(q_nope.to(dev), q_pe.to(dev), new_rows.to(dev), w.to(dev), view,
                                                     meta, 0.3, V, torch.zeros(n, H * V, device=dev)).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    bt, sl = per_token_decode_inputs(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                                     torch.tensor([5, 11], dtype=torch.int32), q)
    assert sl.tolist() == [3, 4, 5, 9, 10, 11] and bt[:, 0].tolist() == [1, 1, 1, 3, 3, 3]
