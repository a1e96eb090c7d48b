"""The real default model (SmolLM2-135M-Instruct) as a GPTQ checkpoint written by the test.

The default GGUF's weights, dequantized to float32 by kvserve's GGUF reader (``iterate_gguf``), have
every decoder projection (q/k/v/o, gate/up/down of all 30 layers) quantized to 4-bit GPTQ, group 64 (it
divides both 576 and 1536), symmetric, with AutoGPTQ's v1 zero points (stored ``z - 1 = 7``), and
packed by ``gptq_packing`` as AutoGPTQ writes it; embeddings and norms stay float32. The directory has
what a downloaded GPTQ model has: config.json with ``quantization_config``, model.safetensors and the
tokenizer. The same weights dequantized (``w = scales * (q - z)``) make a dense float32 checkpoint beside
it. kvserve's unpacking of a stored layer must equal that dequantization exactly, and its greedy tokens
on the GPTQ directory (three prompts batched, then a prefix-cache hit) must equal its own on the dense
one, and transformers' (teacher-forced: each token the argmax of the logits after the ones before it).

Cost: on the CPU kvserve runs 4-bit GPTQ by unpacking each projection per call and a dense float32 matmul
(``cpu_int4``); a decode step still unpacks all 210 projections, so the prompts are short and few tokens
are generated.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.model_loader.gptq_packing import add_quantization_config, pack_layer

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
# What AutoGPTQ writes for a 4-bit symmetric model (damp_percent / true_sequential: calibration settings).
QUANT = dict(quant_method="gptq", bits=4, group_size=64, sym=True, desc_act=False, static_groups=False,
             damp_percent=0.01, true_sequential=True, checkpoint_format="gptq")
# Real prompts; PREFIX (over 16 tokens) fills a KV block, which the HIT request finds cached.
PREFIX = "You are a helpful assistant. Answer in one short sentence and do not repeat the question."
PROMPTS = ["The capital of France is", "def fibonacci(n):", PREFIX + " Largest planet?"]
HIT = PREFIX + " Spider legs?"
MAX_TOKENS, HIT_TOKENS = 8, 4  # generated tokens are this test's cost (module doc)
pytestmark = pytest.mark.slow  # the real model (its fixture skips when the package is missing)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """(GPTQ directory, dense float32 directory) of the same quantized weights."""
    from safetensors.torch import save_file

    from kvserve.model_loader import export_hf
    from kvserve.model_loader.default_model import default_model_path
    from kvserve.model_loader.gguf_loader import iterate_gguf, load_gguf_config

    try:
        gguf = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    root = tmp_path_factory.mktemp("gptq_default_model")
    gptq_dir, dense_dir = str(root / "gptq"), str(root / "dense")
    gptq, dense = {}, {}
    for name, t in iterate_gguf(gguf, load_gguf_config(gguf)):
        layer = name.rpartition(".")[0]
        if name.endswith(".weight") and layer.split(".", 3)[-1] in PROJ:
            dense[name] = pack_layer(gptq, layer, t, QUANT)
        else:
            gptq[name] = dense[name] = t.contiguous()
    assert sum(k.endswith(".qweight") for k in gptq) == 30 * len(PROJ)
    for d, tensors in ((gptq_dir, gptq), (dense_dir, dense)):
        export_hf(gguf, d)  # the tokenizer and config.json (tied embeddings: no lm_head tensor)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    add_quantization_config(gptq_dir, QUANT)
    return gptq_dir, dense_dir


def _llm(path, **kw):
    from kvserve import LLM

    return LLM(model=path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, disable_log_stats=True,
               **kw)


def test_unpacked_layer_equals_dequantized(checkpoints):
    from safetensors import safe_open

    from kvserve.model_loader.gptq_awq import GptqAwqConfig, _to_weight, decode_layer

    gptq_dir, dense_dir = checkpoints
    cfg = GptqAwqConfig.from_dict(QUANT)
    assert cfg.zero_offset == 1  # v1: the stored zero is z - 1
    for layer in ("model.layers.0.self_attn.k_proj", "model.layers.17.mlp.down_proj"):
        with safe_open(os.path.join(gptq_dir, "model.safetensors"), "pt") as f:
            t = {key: f.get_tensor(f"{layer}.{key}") for key in ("qweight", "qzeros", "scales", "g_idx")}
        with safe_open(os.path.join(dense_dir, "model.safetensors"), "pt") as f:
            ref = f.get_tensor(f"{layer}.weight")
        assert torch.equal(_to_weight(decode_layer(layer, cfg, t), cfg.bits, layer).dequantize_unpermuted(), ref)


def test_gptq_greedy_equals_dequantized_dense(checkpoints):
    from kvserve import SamplingParams
    from kvserve.layers.quantization import QuantizedLinear

    gptq_dir, dense_dir = checkpoints
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sp_hit = SamplingParams(temperature=0, max_tokens=HIT_TOKENS, ignore_eos=True)
    llm = _llm(gptq_dir)  # with the directory's tokenizer, as a user runs it
    try:
        assert llm.llm_engine.config.model_config.quantization == "gptq"
        qls = [m for m in llm.llm_engine.engine_core.model_runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(qls) == 30 * 4 and {m.method for m in qls} == {"gptq"}  # qkv, o, gate_up, down per layer
        batch = llm.generate(PROMPTS, sp, use_tqdm=False)
        hit = llm.generate([HIT], sp_hit, use_tqdm=False)[0]
        assert hit.num_cached_tokens >= 16
        assert all(o.outputs[0].text for o in batch)
    finally:
        llm.shutdown()
    prompts = [o.prompt_token_ids for o in batch] + [hit.prompt_token_ids]
    got = [o.outputs[0].token_ids for o in batch] + [hit.outputs[0].token_ids]

    dense = _llm(dense_dir, skip_tokenizer_init=True)
    try:
        outs = dense.generate(prompts, [sp] * len(batch) + [sp_hit], use_tqdm=False)
        want = [o.outputs[0].token_ids for o in outs]
    finally:
        dense.shutdown()
    assert got == want

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    with torch.inference_mode():  # teacher-forced: each greedy token is the argmax after the ones before it
        for ids, toks in zip(prompts, got):
            logits = hf(torch.tensor([list(ids) + list(toks[:-1])])).logits[0, len(ids) - 1:]
            assert logits.argmax(-1).tolist() == list(toks)
