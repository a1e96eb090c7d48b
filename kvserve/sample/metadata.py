"""Per-batch sampling metadata: small device tensors built once per step from the requests.

Everything here is built with per-request Python loops over *requests* (never over
vocabulary entries) and moved to the device host→device; the sampler then works on
whole-batch tensors. A field is ``None`` when no row of the batch needs it, so the sampler
can skip the matching work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from torch import Tensor

from kvserve.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What sampling reads of a request (the worker's ``CachedRequestState``)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: Optional[int]
    generator: Optional[torch.Generator]


# Temperatures below this are greedy (same threshold as ``SamplingParams.greedy``).
GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Batched sampling parameters for ``B`` rows (row ``i`` is ``requests[i]``).

    Random-sampling fields cover only the ``R`` non-greedy rows, listed by ``random_idx``.

    Attributes:
        batch_size: ``B``.
        vocab_size: ``V``.
        all_greedy / all_random: every row greedy / every row random.
        random_idx: long ``[R]`` row indices of the random rows, ``None`` when all rows are
            random (then the random fields cover all ``B`` rows, in order).
        temperature: float32 ``[R]``; ``None`` when all greedy.
        top_k: long ``[R]`` in ``[1, V]`` (``V`` = disabled); ``None`` when no row uses top-k.
        max_top_k: largest enabled ``top_k`` (host int), 0 when ``top_k`` is ``None``.
        top_p: float32 ``[R]`` in ``(0, 1]``; ``None`` when no row uses top-p.
        min_p: float32 ``[R]`` in ``[0, 1]``; ``None`` when no row uses min-p.
        generators: ``{position in the random rows: torch.Generator}`` for seeded rows.
        prompt_ids: long ``[B, Lp]`` prompt ids padded with ``V``; only rows with a
            repetition penalty are filled; ``None`` when no row has one.
        output_ids: long ``[B, Lo]`` output ids padded with ``V``; only rows with any
            penalty are filled; ``None`` when no row has penalties.
        repetition_penalty / frequency_penalty / presence_penalty: float32 ``[B]``
            (identity values 1/0/0 for rows without); ``None`` when no row has penalties.
        min_tokens_rows / min_tokens_cols: long ``[N]`` (row, token) pairs to set to
            ``-inf`` (EOS and stop ids of rows below ``min_tokens``); ``None`` if none.
        logprobs_idx: long ``[L]`` rows that asked for logprobs; ``None`` when none did.
        logprobs_rows: host list ``[L]``, the same rows as ``logprobs_idx``.
        num_logprobs: host list ``[L]`` of each such row's ``logprobs`` count.
        max_num_logprobs: ``max(num_logprobs)`` (host int, capped at ``V``).
    """

    batch_size: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_idx: Optional[Tensor] = None
    temperature: Optional[Tensor] = None
    top_k: Optional[Tensor] = None
    max_top_k: int = 0
    top_p: Optional[Tensor] = None
    min_p: Optional[Tensor] = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    prompt_ids: Optional[Tensor] = None
    output_ids: Optional[Tensor] = None
    repetition_penalty: Optional[Tensor] = None
    frequency_penalty: Optional[Tensor] = None
    presence_penalty: Optional[Tensor] = None
    min_tokens_rows: Optional[Tensor] = None
    min_tokens_cols: Optional[Tensor] = None
    logprobs_idx: Optional[Tensor] = None
    logprobs_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    max_num_logprobs: int = 0

    @property
    def no_penalties(self) -> bool:
        return self.output_ids is None


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host list → device tensor; on CUDA through pinned memory with ``non_blocking`` so
    that building metadata never synchronizes the stream."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> Tensor:
    width = max(1, max((len(r) for r in rows), default=0))
    return _to_device([r + [pad] * (width - len(r)) for r in rows], torch.long, device)


def get_generator(request: "SamplingRequest", device: torch.device) -> torch.Generator:
    """The request's own RNG: created lazily on ``request.generator``, seeded with
    ``sampling_params.seed``, on ``device``."""
    g = request.generator
    if g is None:
        g = torch.Generator(device=device)
        g.manual_seed(request.sampling_params.seed)
        request.generator = g
    return g


def plain_greedy(sp: SamplingParams) -> bool:
    """Greedy with nothing else to build: no penalties, min_tokens or logprobs."""
    return (sp.temperature < GREEDY_EPS and sp.logprobs is None and not sp.min_tokens
            and sp.repetition_penalty == 1.0 and not sp.frequency_penalty and not sp.presence_penalty)


def build_sampling_metadata(
    requests: list["SamplingRequest"], vocab_size: int, device: torch.device | str, all_plain_greedy: bool = False
) -> SamplingMetadata:
    """Collect the batch's sampling parameters into device tensors (see ``SamplingMetadata``).

    ``all_plain_greedy``: the caller knows every request is ``plain_greedy`` (e.g. the input
    batch holds no other), so the per-request check is skipped; False: checked here.

    min_tokens (vLLM semantics): while ``len(output_token_ids) < min_tokens`` the row's
    ``stop_token_ids`` and ``all_stop_token_ids`` are suppressed, and so is
    ``request.eos_token_id`` unless ``ignore_eos`` is set (then EOS does not stop anyway).
    """
    device = torch.device(device)
    V = vocab_size
    B = len(requests)
    params = [r.sampling_params for r in requests]
    if all_plain_greedy or all(map(plain_greedy, params)):  # the common large batch: one pass, nothing to build
        return SamplingMetadata(batch_size=B, vocab_size=V, all_greedy=True, all_random=B == 0)
    greedy = [sp.temperature < GREEDY_EPS for sp in params]
    rand_rows = [i for i in range(B) if not greedy[i]]
    md = SamplingMetadata(
        batch_size=B, vocab_size=V, all_greedy=not rand_rows, all_random=len(rand_rows) == B
    )

    # Random sampling parameters (random rows only).
    if rand_rows:
        rp = [params[i] for i in rand_rows]
        if not md.all_random:
            md.random_idx = _to_device(rand_rows, torch.long, device)
        md.temperature = _to_device([sp.temperature for sp in rp], torch.float32, device)
        ks = [sp.top_k if 0 < sp.top_k < V else V for sp in rp]
        if any(k < V for k in ks):
            md.top_k = _to_device(ks, torch.long, device)
            md.max_top_k = max(k for k in ks if k < V) if all(k < V for k in ks) else V
        if any(sp.top_p < 1.0 for sp in rp):
            md.top_p = _to_device([sp.top_p for sp in rp], torch.float32, device)
        if any(sp.min_p > 0.0 for sp in rp):
            md.min_p = _to_device([sp.min_p for sp in rp], torch.float32, device)
        for j, i in enumerate(rand_rows):
            if params[i].seed is not None:
                md.generators[j] = get_generator(requests[i], device)

    # Penalties (all rows; identity values where a row has none).
    rep = [sp.repetition_penalty for sp in params]
    freq = [sp.frequency_penalty for sp in params]
    pres = [sp.presence_penalty for sp in params]
    has_rep = [p != 1.0 for p in rep]
    has_pen = [has_rep[i] or freq[i] != 0.0 or pres[i] != 0.0 for i in range(B)]
    if any(has_pen):
        md.output_ids = _pad(
            [list(r.output_token_ids) if has_pen[i] else [] for i, r in enumerate(requests)], V, device
        )
        if any(has_rep):
            md.prompt_ids = _pad(
                [list(r.prompt_token_ids) if has_rep[i] else [] for i, r in enumerate(requests)], V, device
            )
        md.repetition_penalty = _to_device(rep, torch.float32, device)
        md.frequency_penalty = _to_device(freq, torch.float32, device)
        md.presence_penalty = _to_device(pres, torch.float32, device)

    # min_tokens: (row, token) pairs to suppress.
    mt_rows: list[int] = []
    mt_cols: list[int] = []
    for i, (r, sp) in enumerate(zip(requests, params)):
        if len(r.output_token_ids) >= sp.min_tokens:
            continue
        ids = set(sp.stop_token_ids or ()) | set(sp.all_stop_token_ids or ())
        if r.eos_token_id is not None and not sp.ignore_eos:
            ids.add(r.eos_token_id)
        ids = sorted(t for t in ids if 0 <= t < V)
        mt_rows += [i] * len(ids)
        mt_cols += ids
    if mt_rows:
        md.min_tokens_rows = _to_device(mt_rows, torch.long, device)
        md.min_tokens_cols = _to_device(mt_cols, torch.long, device)

    # Logprobs.
    lp_rows = [i for i in range(B) if params[i].logprobs is not None]
    if lp_rows:
        md.logprobs_idx = _to_device(lp_rows, torch.long, device)
        md.logprobs_rows = lp_rows
        md.num_logprobs = [min(params[i].logprobs, V) for i in lp_rows]
        md.max_num_logprobs = max(md.num_logprobs)
    return md
