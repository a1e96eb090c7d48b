"""Capacity per KV format (exact numbers) and `kvserve plan-kv`."""

from __future__ import annotations

import json

import pytest

from kvserve.core.kv_capacity import format_plan, plan_kv


def test_plan_kv_llama8b_shape_exact():
    """Llama-3.1-8B shape (32 layers x 8 KV heads x 128), 10 GiB, 8K context, block 16."""
    rows = {r.kv_cache_dtype: r for r in plan_kv(32, 8, 128, 10 * 2**30, 8192)}
    # 2 * 32 * 8 * 128 * 2 bytes = 131072 B/token in bf16; scales: 32 * 8 * 4 (fp8/int8), 32 * 8 * 8 (int4/2).
    assert rows["bfloat16"].bytes_per_token == 131072
    assert rows["fp8_e4m3"].bytes_per_token == 65536 + 1024 and rows["fp8_e4m3"].scale_bytes_per_token == 1024
    assert rows["int4"].bytes_per_token == 32768 + 2048
    assert rows["int2"].bytes_per_token == 16384 + 2048
    assert rows["bfloat16"].tokens == 81920  # 10 GiB / (131072 * 16) = 5120 blocks
    assert rows["int8"].tokens == (10 * 2**30 // (66560 * 16)) * 16
    assert rows["bfloat16"].max_concurrency == 10.0
    assert rows["fp8_e4m3"].vs_reference >= 1.9 and rows["int4"].vs_reference >= 3.5
    assert rows["int2"].vs_reference >= 6.0
    assert "int2" in format_plan(list(rows.values()))
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int3'"):
        plan_kv(32, 8, 128, 2**30, 8192, dtypes=["int3"])


def test_plan_kv_cli(capsys):
    from kvserve.entrypoints.cli import main

    assert main(["plan-kv", "--max-model-len", "2048", "--gpu-memory", "1", "--kv-cache-dtype", "fp8",
                 "--kv-cache-dtype", "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_layers"], out["num_kv_heads"], out["head_dim"]) == (30, 3, 64)  # SmolLM2-135M
    rows = {r["kv_cache_dtype"]: r for r in out["rows"]}
    assert rows["fp8_e4m3"]["bytes_per_token"] == 2 * 30 * 3 * 64 + 30 * 3 * 4
    assert rows["bfloat16"]["tokens"] == (2**30 // (23040 * 16)) * 16


def test_plan_kv_takes_the_exact_filling_blocks_off_the_budget():
    """int4/int2 keep each request's filling block exact: 2 blocks of K and V per layer in the
    reference dtype per request; 256 requests at the Llama-3.1-8B shape = 1 GiB (exact)."""
    budget = 80 * 2**30
    rows = {r.kv_cache_dtype: r for r in plan_kv(32, 8, 128, budget, 8192, max_num_seqs=256)}
    per_request = 2 * 2 * 16 * 8 * 128 * 2 * 32
    assert per_request * 256 == 2**30
    # 256 requests' slots plus the allocator's scratch slot (kvserve/attention/kv_residual.py)
    assert rows["int4"].residual_bytes == rows["int2"].residual_bytes == 2**30 + per_request
    assert rows["fp8_e4m3"].residual_bytes == rows["bfloat16"].residual_bytes == 0
    assert rows["int4"].tokens == ((budget - 2**30 - per_request) // ((32768 + 2048) * 16)) * 16
    assert rows["int4"].vs_reference >= 3.5 and rows["int2"].vs_reference >= 6.0


def test_plan_kv_residual_is_what_the_worker_allocates():
    """plan-kv and the allocator size the exact filling blocks with one function, in the model
    dtype: a float32 model keeps twice the bytes of a bfloat16 one (the 180 vs 361 MiB gap)."""
    from kvserve.attention import kv_residual
    from kvserve.core import kv_capacity

    assert kv_residual.residual_bytes_per_layer is kv_capacity.residual_bytes_per_layer
    bf16 = {r.kv_cache_dtype: r for r in plan_kv(30, 3, 64, 2**30, 2048, dtypes=["int4"], max_num_seqs=256)}
    f32 = {r.kv_cache_dtype: r for r in plan_kv(30, 3, 64, 2**30, 2048, dtypes=["int4"], max_num_seqs=256,
                                                model_dtype="float32")}
    assert f32["int4"].residual_bytes == 2 * bf16["int4"].residual_bytes
    assert f32["int4"].residual_bytes == 30 * kv_residual.residual_bytes_per_layer(256, 16, 3, 64, 4)
