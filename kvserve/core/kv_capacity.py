"""What each KV storage format buys: bytes per token, tokens and concurrency for a budget.

Used by the start-up capacity line (``engine_core.plan_kv_cache``) and by
``kvserve plan-kv``. Bytes per token follow the usual formula
``2 * layers * kv_heads * head_dim * bytes_per_element`` plus the quantized formats' scale
bytes (``KVFormat.scale_bytes_per_token_head`` per layer and KV head); the page size of
``KVCacheSpec`` is the one source of truth and this module only multiplies it out.
Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.core.kv_cache_spec import (KV_FORMATS, MLA_KV_DTYPES, FullAttentionSpec, MLAAttentionSpec,
                                        latent_format_name)

#: Formats known to lose accuracy, with the reason shown at start-up (docs/kv-cache-dtypes.md: which to pick).
LOSSY_KV_FORMATS: dict[str, str] = {
    "int2": "2-bit KV codes with per-token scales wreck accuracy (SmolLM2-135M: perplexity x3.2 even with the "
            "Hadamard rotation and the filling block exact); check `kvserve bench accuracy` for your model before "
            "serving with it",
    "fp8_e5m2": "e5m2 keeps 2 mantissa bits: fp8_e4m3 (the `fp8` default) is more accurate with per-token scales "
                "(SmolLM2-135M perplexity +1.06% vs +0.03%)",
    "int4": "4-bit KV codes with per-token scales raise perplexity (with the Hadamard rotation and the filling block "
            "exact: SmolLM2-135M +1.8% on the 49.3k-token corpus, Gemma 3 270M +7.3% on 6 documents); fp8/int8 are "
            "near-lossless (+0.03% / +0.04%; Gemma 3: +0.6% / +0.5%)",
}


@dataclass
class KVPlanRow:
    """One format's capacity for a model shape and a byte budget."""

    kv_cache_dtype: str
    bytes_per_token: int  # all layers, K and V, scales included
    scale_bytes_per_token: int  # the scales' share of bytes_per_token
    tokens: int  # whole blocks that fit the budget, times block_size
    max_concurrency: float  # tokens / max_model_len
    vs_reference: float  # tokens relative to the reference dtype
    residual_bytes: int = 0  # exact filling blocks of max_num_seqs requests (int4 / int2), off the budget


#: Bytes per element of the model dtypes (the exact filling blocks are kept in the model dtype).
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def residual_shape(num_slots: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Shape of one layer's exact filling blocks for ``num_slots`` requests plus one scratch slot:
    ``(K|V, slot, 2 blocks, block_size, kv_heads, head_size)`` (``kvserve/attention/kv_residual.py``)."""
    return (2, num_slots + 1, 2, block_size, num_kv_heads, head_size)


def residual_bytes_per_layer(num_slots: int, block_size: int, num_kv_heads: int, head_size: int,
                             element_size: int) -> int:
    """Bytes of one layer's residual (``residual_shape``) at ``element_size`` bytes per value: what
    the worker allocates and what ``plan_kv`` takes off the budget."""
    n = 1
    for d in residual_shape(num_slots, block_size, num_kv_heads, head_size):
        n *= d
    return n * element_size


def plan_kv(num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, max_model_len: int,
            block_size: int = 16, dtypes: list[str] | None = None, reference: str = "bfloat16",
            max_num_seqs: int = 0, model_dtype: str | None = None) -> list[KVPlanRow]:
    """Capacity rows for ``dtypes`` (default: every format), all layers full attention.

    Formats that keep the filling block exact (``KVFormat.residual``: int4, int2) first give up
    ``max_num_seqs`` requests' residuals (two blocks of K and V per layer in the reference dtype,
    ``kvserve/attention/kv_residual.py``), as the engine's GPU budget does: the same
    ``residual_bytes_per_layer`` (``max_num_seqs`` slots plus a scratch one) in ``model_dtype``
    (default: ``reference``), the dtype the server runs the model in.

    Raises ValueError for an unknown dtype or non-positive sizes.
    """
    if min(num_layers, num_kv_heads, head_dim, block_size, max_model_len) <= 0 or budget_bytes < 0:
        raise ValueError("layers, kv heads, head dim, block size and max_model_len must be positive")
    dtypes = list(dtypes or [n for n, f in KV_FORMATS.items() if not f.latent])

    res_dtype = model_dtype or reference
    if res_dtype not in MODEL_DTYPE_BYTES:
        raise ValueError(f"model dtype must be one of {sorted(MODEL_DTYPE_BYTES)}, got {res_dtype!r}")
    all_residuals = num_layers * residual_bytes_per_layer(max_num_seqs, block_size, num_kv_heads, head_dim,
                                                          MODEL_DTYPE_BYTES[res_dtype]) if max_num_seqs > 0 else 0

    def tokens(name: str) -> tuple[int, int, int]:
        spec = FullAttentionSpec(block_size, num_kv_heads, head_dim, name, reference)
        page = spec.page_size_bytes * num_layers
        res = all_residuals if spec.format.residual else 0
        return (max(budget_bytes - res, 0) // page) * block_size, spec.bytes_per_token * num_layers, res

    ref_tokens, _, _ = tokens(reference)
    rows = []
    for name in dtypes:
        fmt = KV_FORMATS.get(name)
        if fmt is None:
            raise ValueError(f"unknown kv_cache_dtype {name!r}; choose from {sorted(KV_FORMATS)}")
        tok, bpt, res = tokens(name)
        rows.append(KVPlanRow(name, bpt, num_layers * num_kv_heads * fmt.scale_bytes_per_token_head, tok,
                              tok / max_model_len, tok / ref_tokens if ref_tokens else float("inf"), res))
    return rows


def plan_kv_mla(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, num_heads: int, qk_nope_head_dim: int,
                v_head_dim: int, budget_bytes: int, max_model_len: int, block_size: int = 16,
                dtypes: list[str] | None = None, reference: str = "bfloat16") -> list[KVPlanRow]:
    """Capacity rows of a multi-head latent attention (MLA) model: one row per latent dtype
    (``mla_<dtype>``: ``kv_lora_rank + qk_rope_head_dim`` values per token and layer), then the
    expanded multi-head cache in ``reference`` (``mha_expanded_<reference>``: every head's K of
    ``qk_nope + qk_rope`` and V of ``v_head_dim``) that ``vs_reference`` compares against.

    Raises ValueError for a dtype the latent cannot hold (``latent_format_name``) or bad sizes."""
    if min(num_layers, kv_lora_rank, num_heads, block_size, max_model_len) <= 0 or budget_bytes < 0:
        raise ValueError("layers, kv_lora_rank, heads, block size and max_model_len must be positive")
    names = [latent_format_name(d) for d in (dtypes or MLA_KV_DTYPES)]

    def spec(name: str) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size, 1, kv_lora_rank + qk_rope_head_dim, name, reference,
                                kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, num_heads=num_heads,
                                qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)

    ref_bpt = spec(latent_format_name(reference) if reference in MLA_KV_DTYPES else "mla_bfloat16") \
        .reference_bytes_per_token(reference) * num_layers
    ref_tokens = (budget_bytes // (ref_bpt * block_size)) * block_size
    rows = []
    for name in names:
        s = spec(name)
        tok = (budget_bytes // (s.page_size_bytes * num_layers)) * block_size
        rows.append(KVPlanRow(name, s.bytes_per_token * num_layers, 0, tok, tok / max_model_len,
                              tok / ref_tokens if ref_tokens else float("inf")))
    rows.append(KVPlanRow(f"mha_expanded_{reference}", ref_bpt, 0, ref_tokens, ref_tokens / max_model_len, 1.0))
    return rows


def format_plan(rows: list[KVPlanRow], reference: str = "bfloat16") -> str:
    """A fixed-width table of ``rows``."""
    head = f"{'kv_cache_dtype':<22}{'bytes/token':>12}{'of which scales':>16}{'tokens':>12}" \
           f"{'max concurrency':>17}{'vs ' + reference:>13}{'exact blocks MiB':>18}"
    lines = [head]
    for r in rows:
        lines.append(f"{r.kv_cache_dtype:<22}{r.bytes_per_token:>12}{r.scale_bytes_per_token:>16}{r.tokens:>12}"
                     f"{r.max_concurrency:>16.2f}x{r.vs_reference:>12.2f}x{r.residual_bytes / 2**20:>18.1f}")
    return "\n".join(lines)


def rows_as_dicts(rows: list[KVPlanRow]) -> list[dict]:
    return [asdict(r) for r in rows]
