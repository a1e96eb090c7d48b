"""Bounded KV per request: StreamingLLM attention sinks and H2O heavy-hitter eviction, per block.

Two policies (``--kv-eviction-policy``) bound the KV one request holds, whatever its length:

* ``streaming`` -- StreamingLLM (Xiao et al., arXiv:2309.17453): every query attends to the
  first ``N`` tokens (the *attention sinks*, ``--attention-sinks``, kept as ``ceil(N /
  block_size)`` blocks) and to its last ``W`` tokens (``--max-attention-window``). Blocks
  that lie entirely between the sink blocks and the window of a request's next query go back
  to the pool; their block-table entries become the null block 0, as in a sliding-window group
  (``sliding_window_manager.py``). A request holds at most ``ceil(N / bs) + ceil(W / bs) + 1``
  blocks between steps.
* ``h2o`` -- Heavy-Hitter Oracle (Zhang et al., arXiv:2306.14048), block-granular: a request
  keeps at most ``B // block_size`` blocks (``--kv-budget-tokens B``): its sink blocks, the
  blocks of its recent window ``W``, and the blocks with the largest attention probability
  mass accumulated so far (summed over layers, heads and queries; the attention backends
  report it per block as a by-product, ``kvserve.attention.bounded``). When the next
  allocation would exceed the budget, the lightest unprotected blocks are evicted. The paper
  evicts single tokens; a paged cache frees whole blocks, so a block is kept or dropped as a
  unit (its mass is the sum of its tokens').

Which keys a query sees (the attention side, ``kvserve.attention.bounded``): ``streaming``:
the sink tokens plus its last ``W`` tokens (exactly, token-granular, by position); ``h2o``:
every key of a block still held (causal).

Positions (streaming; the paper's "positions within the cache"): keys are stored rotated at
their original positions (as always), so a query's distance to a window key is already the
in-cache distance. Only the distance to the sinks must shrink by what was evicted between
them: for a query at position ``p`` the evicted span is ``delta(p) = block_size * max(0,
(p - W + 1) // block_size - sink_blocks)`` tokens (the blocks wholly between the sink blocks
and the block holding ``p``'s window start), and its scores against sink keys use the query
rotated back by ``delta(p)`` (rotary is relative: ``<R_{p-d} q, R_s k> = <R_p q, R_{s+d} k>``).
This is a function of ``p`` alone, so the result does not depend on how the scheduler chunks
prefills or batches requests, stored keys are never rewritten (no re-rotation ops, quantized KV
caches work unchanged) and a preempted request recomputes exactly what it had. We chose it over
re-rotating the stored sink keys forward at each eviction (cheaper per step but the sink
distance would then depend on the eviction state at the step that computes a token, so
chunked prefill would give other results than token-by-token decoding, and rewritten sink
blocks could never be shared). ``h2o`` keeps original positions (as the paper does).

Prefix caching (streaming only): under ``streaming`` what every query sees is a function of
its position, ``N`` and ``W`` alone, so the KV of a block is a function of the tokens up to it
and of ``(N, W)``: full blocks are registered by a hash chain salted with ``(cache_salt, N,
W)`` (a request with other per-request limits never shares them) in the pool's hash map, as
sliding-window groups do (no radix tree: the chain's inner blocks leave first). A hit of
``k`` blocks needs only what the next query (position ``k * block_size``) reads: the sink
blocks and the blocks of its window; the blocks in between are the null block in the hit,
found right to left. A finished request frees its window blocks front to back, then its sink
blocks, so the sinks and the tail (what a next chat turn needs) are evicted last. ``h2o``
never caches: its kept blocks depend on the scores, and a block's KV on what was kept.

Per request: ``SamplingParams.attention_sinks`` / ``max_attention_window`` may lower the
engine's values (never raise them: the pool is planned for the engine's).

Pure Python (no torch).
"""

from __future__ import annotations

from typing import Any, Optional

from kvserve.core.block_pool import KVCacheBlock
from kvserve.core.prefix_cache import PrefixMatch
from kvserve.core.single_type_manager import SingleTypeKVCacheManager, _ReqBlocks
from kvserve.core.sliding_window_manager import register_full_blocks
from kvserve.request import Request

def request_limits(sampling_params: Any, sinks: int, window: int) -> tuple[int, int]:
    """A request's ``(sinks, window)``: its ``SamplingParams`` values where set, else the
    engine's ``sinks`` / ``window``. The frontend has checked them against the engine's
    (``kvserve.engine.input_processor.check_request_limits``, the one place); a value above
    the engine's is capped to it."""
    rs = getattr(sampling_params, "attention_sinks", None)
    rw = getattr(sampling_params, "max_attention_window", None)
    return (sinks if rs is None else min(rs, sinks)), (window if rw is None else min(rw, window))


def sink_shift(position: int, sinks: int, window: int, block_size: int) -> int:
    """``delta(p)``: tokens evicted between the sink blocks and query ``position``'s window
    (a multiple of ``block_size``; 0 while nothing is evicted). See the module docstring."""
    sb = -(-sinks // block_size)
    return block_size * max(0, (position - window + 1) // block_size - sb)


class _Bounded:
    """Per-request bounded-KV state: its limits, its next evictable column and (h2o) block masses."""

    __slots__ = ("sinks", "window", "sink_blocks", "next_col", "mass")

    def __init__(self, sinks: int, window: int, block_size: int) -> None:
        self.sinks, self.window = sinks, window
        self.sink_blocks = -(-sinks // block_size)
        self.next_col = self.sink_blocks  # streaming: columns below this are done (sink or evicted)
        self.mass: dict[int, float] = {}  # h2o: column -> accumulated attention mass


class BoundedKVManager(SingleTypeKVCacheManager):
    """One KV cache group's blocks under ``streaming`` or ``h2o`` eviction (module docstring).

    Args:
        num_blocks: blocks in the pool, null block included.
        block_size: tokens per block.
        policy: ``"streaming"`` or ``"h2o"``.
        sinks, window: the engine's attention sinks and (recent) window in tokens.
        budget_tokens: h2o: most tokens a request keeps (``budget_tokens // block_size`` blocks).
        group_id: the KV cache group this manager serves.
        enable_caching: streaming: register full blocks and take prefix hits (module docstring);
            ignored under h2o.

    ``take_evictions()`` hands the scheduler the
    block-table columns nulled since the last call, per request, for ``SchedulerOutput``.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: str, sinks: int, window: int,
                 budget_tokens: int = 0, group_id: int = 0, enable_caching: bool = False) -> None:
        if policy not in ("streaming", "h2o"):
            raise ValueError(f"bounded KV policy must be streaming or h2o, got {policy!r}")
        super().__init__(num_blocks, block_size, enable_caching and policy == "streaming", group_id)
        self.tree = None
        self.pool.prefix_cache = None  # blocks are found by hash, evicted LRU
        self._keys: dict[int, tuple] = {}  # block id -> (parent hash, tokens, salt) it was registered under
        self._hashes: dict[str, list[int]] = {}  # request id -> its salted hash chain
        self.policy = policy
        self.sinks, self.window = sinks, window
        self.budget_blocks = max(budget_tokens // block_size, 1)
        self._bounded: dict[str, _Bounded] = {}
        self._evicted: dict[str, list[int]] = {}
        self.num_evicted_blocks = 0  # cumulative
        self.num_evicted_tokens = 0  # cumulative (block_size per evicted block)

    def _state(self, request: Request) -> _Bounded:
        b = self._bounded.get(request.request_id)
        if b is None:
            s, w = request_limits(request.sampling_params, self.sinks, self.window)
            b = self._bounded[request.request_id] = _Bounded(s, w, self.block_size)
        return b

    # ---- eviction -------------------------------------------------------------------
    def evict(self, request: Request, num_new_tokens: int = 0, num_computed_tokens: Optional[int] = None) -> int:
        """Free the request's blocks no query from its next one (``num_computed_tokens``, default
        the request's) needs (streaming), or the lightest ones over the budget once
        ``num_new_tokens`` more tokens are allocated (h2o). Their entries become the null block.
        Returns how many were freed."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return 0
        b = self._state(request)
        c = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        bs = self.block_size
        null = self.pool.null_block
        win_col = max(c - b.window + 1, 0) // bs  # the block holding the next query's window start
        if self.policy == "streaming":
            cols = range(b.next_col, min(win_col, len(st.blocks)))
            if win_col > b.next_col:
                b.next_col = win_col
        else:
            live = [i for i in range(b.sink_blocks, min(win_col, len(st.blocks))) if st.blocks[i] is not null]
            held = sum(1 for x in st.blocks if x is not null)
            need = max(-(-(c + num_new_tokens) // bs) - len(st.blocks), 0)
            over = held + need - self.budget_blocks
            if over <= 0 or not live:
                return 0
            mass = b.mass
            live.sort(key=lambda i: (mass.get(i, 0.0), i))  # lightest first; the oldest on ties
            cols = sorted(live[:over])
        freed: list[KVCacheBlock] = []
        done = []
        for i in cols:
            blk = st.blocks[i]
            if blk is not null:
                freed.append(blk)
                st.blocks[i] = null
                st.ids[i] = 0
                done.append(i)
        if freed:
            self.pool.free(freed)
            self._evicted.setdefault(request.request_id, []).extend(done)
            self.num_evicted_blocks += len(freed)
            self.num_evicted_tokens += len(freed) * bs
            for i in done:
                b.mass.pop(i, None)
        return len(freed)

    def take_evictions(self) -> dict[str, list[int]]:
        """Request id -> block-table columns nulled since the last call (then forgotten)."""
        out, self._evicted = self._evicted, {}
        return out

    def observe_block_mass(self, request_id: str, mass: dict[int, float]) -> None:
        """Add a step's attention mass per block-table column (h2o's heavy-hitter score)."""
        b = self._bounded.get(request_id)
        if b is None:
            return
        acc = b.mass
        for col, m in mass.items():
            acc[col] = acc.get(col, 0.0) + m

    # ---- SingleTypeKVCacheManager ------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> Optional[list[KVCacheBlock]]:
        """As the base class, after evicting what the request's next step no longer reads."""
        self._state(request)  # (h2o: masses are observed from the first step on)
        self.evict(request, num_new_tokens)
        return super().allocate_slots(request, num_new_tokens, new_computed_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        self.evict(request, num_new_tokens)
        return super().can_allocate(request, num_new_tokens, new_computed_blocks)

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks (and its h2o masses): the blocks after
        the sinks front to back, then the sink blocks (LRU: the sinks and the tail go last)."""
        b = self._bounded.pop(request.request_id, None)
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            sb = b.sink_blocks if b is not None else 0
            self.pool.free(st.blocks[sb:] + st.blocks[:sb])
        self._evicted.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)

    # ---- prefix caching (streaming) ----------------------------------------------------
    def _chain(self, request: Request, num_blocks: int) -> tuple[list[int], tuple]:
        """The request's hash chain over its first ``num_blocks`` blocks, salted with its cache
        salt and its ``(sinks, window)``, and that salt."""
        s, w = request_limits(request.sampling_params, self.sinks, self.window)
        salt = (getattr(request, "cache_salt", None), s, w)
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            toks, bs = request.all_token_ids, self.block_size
            h = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                h = hash((h, tuple(toks[i * bs:(i + 1) * bs]), salt))
                hashes.append(h)
        return hashes, salt

    def _lookup(self, request: Request, hashes: list[int], salt: tuple, i: int) -> Optional[KVCacheBlock]:
        """The cached block holding block ``i`` of the request (its key re-checked), or None."""
        b = self.pool.cached.get(hashes[i])
        if b is None:
            return None
        bs = self.block_size
        key = (hashes[i - 1] if i else None, tuple(request.all_token_ids[i * bs:(i + 1) * bs]), salt)
        return b if self._keys.get(b.block_id) == key else None

    def get_computed_blocks(self, request: Request) -> tuple[PrefixMatch, int]:
        """Longest hit (block-granular; the last token is never counted): ``k`` entries whose sink
        blocks and whose blocks the query at ``k * block_size`` sees are cached, the others the
        null block. Nothing is referenced (pass it to ``allocate_slots``)."""
        out = PrefixMatch()
        m = (request.num_tokens - 1) // self.block_size
        if not self.enable_caching or m <= 0:
            return out, 0
        s, w = request_limits(request.sampling_params, self.sinks, self.window)
        bs, sb = self.block_size, -(-s // self.block_size)
        hashes, salt = self._chain(request, m)
        found = [self._lookup(request, hashes, salt, i) for i in range(m)]
        lead = next((i for i, b in enumerate(found) if b is None), m)  # leading cached blocks
        run = 0  # cached blocks ending at k - 1
        runs = []
        for b in found:
            run = run + 1 if b is not None else 0
            runs.append(run)
        for k in range(m, 0, -1):
            lo = max(max(k * bs - w + 1, 0) // bs, min(sb, k))  # first window column of query k * bs
            if lead >= min(sb, k) and (lo >= k or runs[k - 1] >= k - lo):
                null = self.pool.null_block
                out.extend(found[i] if i < sb or i >= lo else null for i in range(k))
                return out, k * bs
        return out, 0

    def _cache_full_blocks(self, request: Request, st: _ReqBlocks, num_tokens: int) -> None:
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        if num_full <= st.num_cached:
            return
        hashes, salt = self._chain(request, num_full)
        register_full_blocks(self, request, st, num_full, hashes, salt)

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (null entries excluded)."""
        st = self._reqs.get(request_id)
        return 0 if st is None else sum(b is not self.pool.null_block for b in st.blocks)
