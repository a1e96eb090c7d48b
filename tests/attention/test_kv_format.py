"""The KV format object (``kvserve/attention/kv_format.py``), one test per KV dtype: store then
load round-trips exactly where the format is lossless and within its error bound where lossy;
copy-on-write, gathers and the view's binding follow the format, not the tensor."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_format import KVCacheView, format_of_spec, kv_format_for, plain_format, view_of
from kvserve.core.kv_cache_spec import KV_FORMATS, FullAttentionSpec

LOSSLESS = ["float32"]
# Lossless for values already in the storage dtype (the cast is exact).
CAST = ["bfloat16", "float16"]
QUANT = ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]
# Worst-case |x - load(store(x))| / max|x| per (token, head) row: half a code step plus the
# float16 scale rounding (as tests/attention/test_kv_quant.py's ROW_REL_BOUND).
ROW_REL_BOUND = {"fp8_e4m3": 2 ** -4 + 1e-3, "fp8_e5m2": 2 ** -3 + 1e-3, "int8": 0.5 / 127 + 1e-3,
                 "int4": 1 / 15 + 2e-3, "int2": 1 / 3 + 2e-3}
BS, HKV, D, NB = 4, 2, 32, 6


def _store_all(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``x [2, T, Hkv, D]`` (K, V) into slots ``[BS, BS + T)`` of a fresh cache in
    format ``name``; returns ``(cache, slots)``."""
    fmt = kv_format_for(name, D)
    cache = torch.zeros(fmt.cache_shape(NB, BS, HKV), dtype=fmt.storage_dtype)
    slots = torch.arange(BS, BS + x.shape[1])
    fmt.store(x[0], x[1], cache, slots)
    return cache, slots


def _load_all(name: str, cache: torch.Tensor, num: int) -> torch.Tensor:
    """K and V of slots ``[BS, BS + num)`` as float32 ``[2, num, Hkv, D]``, loaded page-wise."""
    fmt = kv_format_for(name, D)
    ids = torch.arange(1, NB)
    kv = [fmt.load_blocks(cache, half, ids, torch.float32).reshape(-1, HKV, D)[:num] for half in (0, 1)]
    return torch.stack(kv)


@pytest.mark.parametrize("name", LOSSLESS + CAST + QUANT)
def test_store_then_load_round_trips(name):
    fmt = kv_format_for(name, D)
    assert fmt.desc is KV_FORMATS[name] and fmt.row_elems == KV_FORMATS[name].row_elems(D)
    gen = torch.Generator().manual_seed(0)
    t = 13  # crosses block boundaries, leaves the last block partial
    x = torch.randn(2, t, HKV, D, generator=gen) * torch.rand(2, t, HKV, 1, generator=gen) * 10
    if name in CAST:
        x = x.to(fmt.storage_dtype).float()  # representable: the round trip is exact
    cache, slots = _store_all(name, x)
    y = _load_all(name, cache, t)
    if name in LOSSLESS + CAST:
        assert torch.equal(y, x)
    else:
        err = (x - y).abs().amax(-1) / x.abs().amax(-1)
        assert err.max() <= ROW_REL_BOUND[name]
        # the rows the store wrote are quantize's rows, at their slots in the page layout
        rows = fmt.pages_to_rows(cache[:, 1:]).reshape(2, -1, HKV, fmt.row_elems)[:, :t]
        assert torch.equal(rows.view(torch.uint8), fmt.quantize(x).view(torch.uint8))
    # loading by gather (per-row form, then dequantize) reads the same values
    k, v = fmt.gather(cache, torch.arange(1, NB, dtype=torch.int32)[None], NB - 1)
    assert torch.equal(fmt.dequantize(k[0, :t], torch.float32), y[0])
    assert torch.equal(fmt.dequantize(v[0, :t], torch.float32), y[1])
    # slots nobody stored stay zero (negative slots are skipped)
    fmt.store(x[0, :1], x[1, :1], cache, torch.tensor([-1]))
    assert not cache[:, 0].view(torch.uint8).any()


@pytest.mark.parametrize("name", LOSSLESS + CAST + QUANT)
def test_copy_slots_moves_values_exactly(name):
    fmt = kv_format_for(name, D)
    x = torch.randn(2, 8, HKV, D, generator=torch.Generator().manual_seed(1))
    cache, _ = _store_all(name, x)  # blocks 1 and 2
    fmt.copy_slots(cache, torch.tensor([BS, BS + 1, BS + 2]), torch.tensor([4 * BS, 4 * BS + 1, 4 * BS + 2]))
    y = _load_all(name, cache, 4 * BS)  # slots BS .. 5 BS
    assert torch.equal(y[:, 3 * BS:3 * BS + 3], y[:, :3])


def test_rotation_and_flags_follow_the_format():
    for name, f in KV_FORMATS.items():
        fmt = kv_format_for(name, D)
        assert (fmt.rotation() is not None) == f.rotated == fmt.rotated
        assert fmt.residual == f.residual and fmt.quantized == f.quantized
        assert fmt.kernel_code == (0 if not f.quantized else fmt.kernel_code) and (fmt.kernel_code > 0) == f.quantized
    spec = FullAttentionSpec(BS, HKV, D, "int4", "float32")
    assert format_of_spec(spec) is kv_format_for("int4", D)


def test_view_binds_cache_and_format_and_checks_them():
    fmt = kv_format_for("int4", D)
    cache = torch.zeros(fmt.cache_shape(NB, BS, HKV), dtype=fmt.storage_dtype)
    view = KVCacheView.bind(cache, fmt)
    assert view.format is fmt and view.residual is None and not view.values_rotated
    assert torch.equal(view.rotation, fmt.rotation())
    assert view.block_size == BS and view.num_kv_heads == HKV
    with pytest.raises(ValueError, match="int8 cache"):
        KVCacheView.bind(cache, kv_format_for("int8", D))  # same dtype, other row width
    plain = view_of(torch.zeros(2, NB, BS, HKV, D, dtype=torch.float64))
    assert plain.format.name == "float64" and plain.rotation is None
    with pytest.raises(ValueError, match="not a plain KV storage dtype"):
        plain_format(torch.uint8, D)
