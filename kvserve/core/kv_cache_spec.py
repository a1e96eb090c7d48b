"""KV cache specs: the format of each layer's paged KV cache, and the groups layers form.

A ``KVCacheSpec`` describes one layer's cache: block size, KV heads, head size, the storage
format (``dtype``: bytes per element, scale layout) and the compute dtype, and its attention
type (full, or a sliding window). Layers with equal specs form a ``KVCacheGroup``: one block
table per request per group, one block pool per group. ``KVCacheConfig`` is the whole
cache: its groups and how many blocks each holds. Pool sizing, the start-up capacity line,
the memory profile and graph sizing read ``page_size_bytes`` from here; nothing else
recomputes bytes per token.

Pure Python (no torch): the scheduler process reads these too. The layout is vLLM v1's
``kv_cache_interface`` idea in our own shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class KVFormat:
    """A KV storage format.

    Quantized formats store each (token, KV head) row of K (and of V) as packed codes plus
    their scales, ``row_elems(head_size)`` one-byte elements per row; within a block's page
    all codes come first, then all scales (``kvserve/attention/kv_quant.py``: scheme and
    layout). The scales live in the block (store, copy-on-write, prefix sharing, tiers need
    no extra tensor). Its torch side -- storage dtype, store and load routines, rotation, the
    kernel variant it selects -- is ``kvserve.attention.kv_format.KVCacheFormat``, bound to
    each attention layer with its cache.

    Attributes:
        name: the ``--kv-cache-dtype`` value.
        bits: bits per stored K or V element.
        torch_dtype: name of the torch dtype the cache tensor is allocated in.
        scale_bytes_per_token_head: bytes of scales stored per token and KV head, K and V
            together (0: no scales).
        asymmetric: codes are unsigned with a per-row minimum (``x = q * scale + min``);
            otherwise symmetric (``x = q * scale``).
        rotated: the attention layer stores and attends in a rotated basis of the head
            dimension (Hadamard, QuaRot arXiv:2404.00456; ``kvserve/attention/kv_rotation.py``).
        residual: each request's filling block is also kept exact, in the compute dtype, and
            a query reads its own block from there (KIVI's residual, arXiv:2402.02750;
            ``kvserve/attention/kv_residual.py``). The pages are written as for any format.
        latent: multi-head latent attention's cache (DeepSeek-V2, arXiv:2405.04434): one row
            per token -- the compressed KV latent and the shared RoPE key -- with no V half
            and no head dimension (``MLAAttentionSpec``; ``kvserve/attention/mla.py``).
    """

    name: str
    bits: int
    torch_dtype: str
    scale_bytes_per_token_head: int = 0
    asymmetric: bool = False
    rotated: bool = False
    residual: bool = False
    latent: bool = False

    @property
    def kv_halves(self) -> int:
        """Rows stored per token and KV head: 2 (K and V), 1 for a latent format."""
        return 1 if self.latent else 2

    @property
    def quantized(self) -> bool:
        return self.scale_bytes_per_token_head > 0

    def row_elems(self, head_size: int) -> int:
        """Elements of one (token, KV head) row of K or of V in the cache tensor's dtype
        (its codes and scale bytes; it sizes the page, the page layout places them). A
        quantized latent row is its codes, then its fp16 scale, padded to 16 bytes."""
        if self.latent and self.quantized:
            return -(-(head_size * self.bits // 8 + self.scale_bytes_per_token_head) // 16) * 16
        if not self.quantized:
            return head_size
        return head_size * self.bits // 8 + self.scale_bytes_per_token_head // 2


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f for f in (
        KVFormat("float32", 32, "float32"),
        KVFormat("bfloat16", 16, "bfloat16"),
        KVFormat("float16", 16, "float16"),
        # Per-token-per-head symmetric scale (fp16) after each row: x = code * scale.
        KVFormat("fp8_e4m3", 8, "float8_e4m3fn", 4),
        KVFormat("fp8_e5m2", 8, "float8_e5m2", 4),
        KVFormat("int8", 8, "int8", 4),
        # Per-token-per-head asymmetric (fp16 scale + fp16 min): x = code * scale + min, of
        # Hadamard-rotated K and V rows (kvserve/attention/kv_rotation.py); the filling block
        # exact (kvserve/attention/kv_residual.py).
        KVFormat("int4", 4, "uint8", 8, asymmetric=True, rotated=True, residual=True),
        KVFormat("int2", 2, "uint8", 8, asymmetric=True, rotated=True, residual=True),
        # MLA's latent rows (one per token: kv_lora_rank + qk_rope_head_dim values), named
        # by MLAAttentionSpec from --kv-cache-dtype (latent_format_name); not a flag value.
        KVFormat("mla_float32", 32, "float32", latent=True),
        KVFormat("mla_bfloat16", 16, "bfloat16", latent=True),
        KVFormat("mla_float16", 16, "float16", latent=True),
        # fp8 e4m3 codes of the whole row, then one fp16 scale per token (x = code * scale),
        # in uint8 rows padded to 16 bytes (kvserve/attention/kv_format.py: MLALatentFormat).
        KVFormat("mla_fp8_e4m3", 8, "uint8", 2, latent=True),
    )
}

#: --kv-cache-dtype values an MLA latent cache can store (the rest are refused at start-up).
MLA_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")


def latent_format_name(kv_cache_dtype: str) -> str:
    """The latent format storing MLA rows in ``kv_cache_dtype`` (a resolved ``--kv-cache-dtype``).

    Raises ValueError naming the choices for a dtype the latent cannot hold (int8 / int4 / int2
    quantize per head and rotate the head dimension; the latent has neither; fp8_e5m2 is not
    built for it)."""
    name = get_kv_format(kv_cache_dtype).name
    if name not in MLA_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: a multi-head latent attention (MLA) cache stores "
                         f"its latent in one of {list(MLA_KV_DTYPES)} (or auto, fp8); the other quantized KV formats "
                         f"do not apply to the latent")
    return "mla_" + name

#: ``--kv-cache-dtype`` aliases (vLLM: ``fp8`` means e4m3).
KV_FORMAT_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}


def get_kv_format(name: str) -> KVFormat:
    """The format of ``--kv-cache-dtype name``. Raises ValueError listing the choices."""
    fmt = KV_FORMATS.get(KV_FORMAT_ALIASES.get(name, name))
    if fmt is None:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of "
                         f"{sorted(KV_FORMATS) + sorted(KV_FORMAT_ALIASES)} or auto")
    return fmt


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's paged KV cache format.

    Attributes:
        block_size: tokens per block.
        num_kv_heads: KV heads of the layer (on this rank).
        head_size: per-head dim.
        dtype: storage format name (a key of ``KV_FORMATS``).
        compute_dtype: dtype attention computes in (the model dtype).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    compute_dtype: str

    def __post_init__(self) -> None:
        if self.format.latent and not isinstance(self, MLAAttentionSpec):
            raise ValueError(f"kv_cache_dtype {self.dtype!r} is the latent format of multi-head latent attention "
                             f"layers; other layers store K and V (choose a --kv-cache-dtype value)")

    @property
    def format(self) -> KVFormat:
        return get_kv_format(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V of ``block_size`` tokens, plus scales."""
        f = self.format
        if f.latent:  # one row per token: values, or codes + scale padded (row_elems)
            return self.block_size * self.num_kv_heads * f.row_elems(self.head_size) * max(f.bits // 8, 1)
        per_token = f.kv_halves * self.num_kv_heads * self.head_size * f.bits // 8
        per_token += self.num_kv_heads * f.scale_bytes_per_token_head
        return self.block_size * per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer's cache (scales included)."""
        return self.page_size_bytes // self.block_size

    def max_blocks_per_request(self, max_model_len: int) -> int:
        """Most blocks one request can hold at once in this layer."""
        return -(-max_model_len // self.block_size)

    @property
    def type_name(self) -> str:
        return "full_attention"

    def reference_bytes_per_token(self, dtype: str) -> int:
        """Bytes per token of the equal unquantized cache in ``dtype`` (what a format's saving
        is measured against)."""
        return dataclasses.replace(self, dtype=dtype).bytes_per_token


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A layer that attends to every earlier token (it may still mask by a window: such a
    layer keeps its whole history in this spec)."""


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """A multi-head latent attention layer (DeepSeek-V2, arXiv:2405.04434): each token keeps one
    row of ``kv_lora_rank + qk_rope_head_dim`` values (``num_kv_heads`` 1, ``head_size`` that
    width, ``dtype`` a latent format), whatever the number of query heads; under tensor
    parallelism every rank keeps the whole row (the heads split, the latent is replicated).

    Attributes (beyond ``KVCacheSpec``'s): the latent's parts, and the heads and head dims of
    the equal multi-head cache (``reference_bytes_per_token``).
    """

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_heads: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    tp_size: int = 1

    @property
    def type_name(self) -> str:
        rep = f", latent replicated on {self.tp_size} ranks" if self.tp_size > 1 else ""
        return f"mla_latent({self.kv_lora_rank}+{self.qk_rope_head_dim}{rep})"

    def reference_bytes_per_token(self, dtype: str) -> int:
        """Bytes per token of the expanded multi-head cache: every head's K (qk_nope + qk_rope)
        and V (v_head_dim) in ``dtype``, all heads (as one rank of ``tp_size`` would hold
        ``num_heads / tp_size`` of them, the comparison uses this rank's heads)."""
        heads = self.num_heads // max(self.tp_size, 1)
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return heads * per_head * get_kv_format(dtype).bits // 8


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A layer that attends to the last ``sliding_window`` tokens only; blocks entirely outside
    the window can return to the pool."""

    sliding_window: int = 0

    def max_blocks_per_request(self, max_model_len: int) -> int:
        # The window spans at most ceil(window / block_size) + 1 blocks once unaligned.
        return min(-(-max_model_len // self.block_size), -(-self.sliding_window // self.block_size) + 1)

    @property
    def type_name(self) -> str:
        return f"sliding_window({self.sliding_window})"


@dataclass(frozen=True)
class BoundedKVSpec(KVCacheSpec):
    """A layer whose per-request KV is bounded by an eviction policy (``kvserve.core.bounded_kv``):
    ``streaming`` (StreamingLLM, arXiv:2309.17453) keeps ``sink_tokens`` first tokens and the last
    ``window`` tokens; ``h2o`` (arXiv:2306.14048) keeps at most ``budget_tokens // block_size``
    blocks (sinks, the recent window, the heaviest-attended blocks). Evicted block-table entries
    become the null block, as in a sliding-window group."""

    policy: str = "streaming"
    sink_tokens: int = 0
    window: int = 1
    budget_tokens: int = 0

    @property
    def sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def budget_blocks(self) -> int:
        """Blocks a request keeps between steps (h2o), or sinks + window blocks (streaming)."""
        if self.policy == "h2o":
            return max(self.budget_tokens // self.block_size, 1)
        return self.sink_blocks + -(-self.window // self.block_size) + 1

    def max_blocks_per_request(self, max_model_len: int) -> int:
        return min(-(-max_model_len // self.block_size), self.budget_blocks)

    def prefill_blocks(self, num_tokens: int) -> int:
        """Blocks held while ``num_tokens`` tokens compute in one step (kept blocks + the chunk)."""
        if self.policy == "h2o":
            return self.budget_blocks + -(-num_tokens // self.block_size) + 1
        return self.sink_blocks + -(-(self.window - 1 + num_tokens) // self.block_size) + 1

    @property
    def type_name(self) -> str:
        if self.policy == "h2o":
            return f"h2o(sinks={self.sink_tokens}, window={self.window}, budget={self.budget_tokens})"
        return f"streaming(sinks={self.sink_tokens}, window={self.window})"


@dataclass
class KVCacheGroup:
    """Layers that share one block table per request (equal specs).

    Attributes:
        group_id: index in ``KVCacheConfig.groups``.
        layer_indices: the model's attention layers in this group.
        spec: their common spec.
        num_blocks: blocks in this group's pool (null block included).
    """

    group_id: int
    layer_indices: list[int]
    spec: KVCacheSpec
    num_blocks: int = 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block id in this group: one page in each of its layers."""
        return len(self.layer_indices) * self.spec.page_size_bytes


@dataclass
class KVCacheConfig:
    """The whole KV cache: groups of layers and their pools."""

    groups: list[KVCacheGroup] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_indices) for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id in every group together (the unit the budget is split in)."""
        return sum(g.page_size_bytes for g in self.groups)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs across all layers when every layer keeps it."""
        return sum(len(g.layer_indices) * g.spec.bytes_per_token for g in self.groups)

    @property
    def total_bytes(self) -> int:
        return sum(g.num_blocks * g.page_size_bytes for g in self.groups)

    def layer_group(self) -> dict[int, int]:
        """Layer index -> group id."""
        return {layer: g.group_id for g in self.groups for layer in g.layer_indices}

    def describe(self) -> str:
        """One line per group for the start-up log."""
        return "; ".join(
            f"group {g.group_id}: {len(g.layer_indices)} layers {g.spec.type_name} {g.spec.dtype} "
            f"{g.spec.num_kv_heads}x{g.spec.head_size}, {g.spec.page_size_bytes} B/page, {g.num_blocks} blocks"
            for g in self.groups)


def group_layers(layer_specs: dict[int, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with equal specs, in order of first appearance.

    Raises ValueError when the specs disagree on block size (one block size per engine).
    """
    groups: list[KVCacheGroup] = []
    by_spec: dict[KVCacheSpec, KVCacheGroup] = {}
    for layer in sorted(layer_specs):
        spec = layer_specs[layer]
        g = by_spec.get(spec)
        if g is None:
            g = by_spec[spec] = KVCacheGroup(len(groups), [], spec)
            groups.append(g)
        g.layer_indices.append(layer)
    if len({g.spec.block_size for g in groups}) > 1:
        raise ValueError("all KV cache groups must use one block size")
    return groups


def prefill_blocks(spec: KVCacheSpec, num_tokens: int) -> int:
    """Blocks of one request while it computes ``num_tokens`` tokens in one step (a window
    group holds the window before the chunk and the chunk itself; a full group, everything)."""
    if isinstance(spec, SlidingWindowSpec):
        return -(-(spec.sliding_window - 1 + num_tokens) // spec.block_size) + 1
    if isinstance(spec, BoundedKVSpec):
        return spec.prefill_blocks(num_tokens)
    return 0


def _reserve(g: KVCacheGroup, max_model_len: int, max_num_batched_tokens: Optional[int]) -> int:
    """Blocks a window group keeps beyond the per-request shares, so that a step's prefill
    chunk (up to ``max_num_batched_tokens`` tokens) fits beside the window."""
    if not isinstance(g.spec, (SlidingWindowSpec, BoundedKVSpec)):
        return 0
    chunk = max_num_batched_tokens or g.spec.block_size
    return max(prefill_blocks(g.spec, chunk) - g.spec.max_blocks_per_request(max_model_len), 0)


def make_kv_cache_config(layer_specs: dict[int, KVCacheSpec], kv_bytes: Optional[int],
                         num_blocks_override: Optional[int] = None,
                         max_model_len: Optional[int] = None,
                         max_num_batched_tokens: Optional[int] = None,
                         max_num_seqs: Optional[int] = None) -> KVCacheConfig:
    """Split a byte budget into blocks per KV cache group.

    One group takes the whole budget. Several groups (a hybrid model: full-attention and
    sliding-window layers) get blocks in proportion to what one request of
    ``max_model_len`` tokens holds in each (``max_blocks_per_request``): a window group
    needs ``ceil(window / block_size) + 1`` blocks per request however long it is, so the
    budget buys about ``kv_bytes / bytes_per_request(max_model_len)`` such requests instead
    of ``kv_bytes / (bytes_per_token * max_model_len)``. A window group first keeps a
    reserve for one step's prefill chunk of ``max_num_batched_tokens`` tokens (a chunk's
    blocks are all held during its step). Without ``max_model_len`` every group gets the
    same number of blocks.

    That plan bets on long requests: with shorter ones the full-attention groups hold many
    more requests than the window groups. So when a model mixes both, the window groups are
    sized for ``max_num_seqs`` running requests (more can never run at once, and what they
    do not hold keeps finished requests' window tails for prefix hits), as long as that
    takes at most half the budget; the full-attention groups share the rest. Hybrid
    capacity at ``max_model_len`` then falls, which a smaller ``max_num_seqs`` gives back.

    Args:
        layer_specs: per attention layer, its spec.
        kv_bytes: the budget in bytes (ignored when ``num_blocks_override`` is set).
        num_blocks_override: force this many blocks per group (null block included).
        max_model_len: the request length the split is planned for.
        max_num_batched_tokens: the per-step token budget (the largest prefill chunk).
        max_num_seqs: most requests running at once (None: no window floor).

    Raises ValueError when there is no attention layer.
    """
    cfg = KVCacheConfig(group_layers(layer_specs))
    if not cfg.groups:
        raise ValueError("the model has no attention layers")
    if num_blocks_override is not None:
        for g in cfg.groups:
            g.num_blocks = num_blocks_override
        return cfg
    budget = max(int(kv_bytes), 0)
    if len(cfg.groups) == 1 or max_model_len is None:
        n = budget // cfg.bytes_per_block
        for g in cfg.groups:
            g.num_blocks = n
        return cfg
    # Each group keeps its null block and its reserve; the rest is split by per-request need.
    reserve = [1 + _reserve(g, max_model_len, max_num_batched_tokens) for g in cfg.groups]
    budget = max(budget - sum(r * g.page_size_bytes for r, g in zip(reserve, cfg.groups)), 0)
    need = [g.spec.max_blocks_per_request(max_model_len) for g in cfg.groups]
    per_request = sum(n * g.page_size_bytes for n, g in zip(need, cfg.groups))
    bounded = [isinstance(g.spec, (SlidingWindowSpec, BoundedKVSpec)) for g in cfg.groups]
    if not max_num_seqs or all(bounded) or not any(bounded):
        for n, r, g in zip(need, reserve, cfg.groups):
            g.num_blocks = budget * n // per_request + r
        return cfg
    win_bytes = sum(n * g.page_size_bytes for n, g, b in zip(need, cfg.groups, bounded) if b)
    # Requests the window groups are sized for: the proportional plan's, raised towards
    # max_num_seqs while their windows take at most half the budget.
    seqs = max(budget / per_request, min(max_num_seqs, budget / 2 / win_bytes))
    rest = budget - int(seqs * win_bytes)
    full_bytes = per_request - win_bytes
    for n, r, g, b in zip(need, reserve, cfg.groups, bounded):
        g.num_blocks = (int(seqs * n) if b else rest * n // full_bytes) + r
    return cfg


def bytes_per_request(cfg: KVCacheConfig, max_model_len: int, hybrid: bool = True) -> int:
    """Bytes one request of ``max_model_len`` tokens holds at most between steps, over all
    groups; with ``hybrid=False``, as if every layer kept its whole history."""
    if not hybrid:
        return cfg.bytes_per_token * max_model_len
    return sum(g.spec.max_blocks_per_request(max_model_len) * g.page_size_bytes for g in cfg.groups)


def max_concurrency(cfg: KVCacheConfig, max_model_len: int, max_num_batched_tokens: Optional[int] = None) -> float:
    """How many requests of ``max_model_len`` tokens the groups' pools hold at once between
    steps (the scarcest group decides; null blocks and prefill reserves excluded)."""
    return min((g.num_blocks - 1 - _reserve(g, max_model_len, max_num_batched_tokens))
               / g.spec.max_blocks_per_request(max_model_len) for g in cfg.groups)


def max_request_tokens(cfg: KVCacheConfig, max_num_batched_tokens: Optional[int] = None) -> Optional[int]:
    """Longest request the cache can hold alone (None: unbounded, every group is a window
    group whose pool holds a window plus a prefill chunk of ``max_num_batched_tokens``).
    0 when some window group cannot hold even that."""
    best = None
    for g in cfg.groups:
        usable = max(g.num_blocks - 1, 0)
        if isinstance(g.spec, (SlidingWindowSpec, BoundedKVSpec)):
            if usable >= prefill_blocks(g.spec, max_num_batched_tokens or g.spec.block_size):
                continue
            return 0
        tokens = usable * g.spec.block_size
        best = tokens if best is None else min(best, tokens)
    return best
