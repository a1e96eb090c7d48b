"""GPTQ and AWQ checkpoints (``model_loader.gptq_awq``) written here, loaded kept quantized.

The checkpoints are made by this test from a seeded random tiny Llama: each decoder projection is
quantized with min/max round-to-nearest (the values need not be calibrated: the test checks the storage
format, not the quantizer) and packed exactly as the reference tools write it (``gptq_packing``: AutoGPTQ /
GPTQModel's GPTQ v1/v2 with ``g_idx`` and ``desc_act``, AutoAWQ's "gemm" with its interleaved nibble order;
its docstring gives the layouts).

Both dequantize as ``w = scales * (q - z)``. The reference is that dequantization written into a dense
float32 HF model: kvserve's unpacked weights must equal it exactly and its greedy tokens (batched, and
with a prefix-cache hit) must equal transformers' on it; tensor parallel 2 (gloo) must equal one rank.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kvserve.layers.quantization import QuantizedLinear
from kvserve.model_loader.gptq_awq import Decoded, GptqAwqConfig, _to_weight, decode_layer
from tests.model_loader.gptq_packing import add_quantization_config, pack_layer

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
           architectures=["LlamaForCausalLM"])
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
# name -> quantization_config (written to config.json)
VARIANTS = {
    "gptq_g32_sym": dict(quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False),
    "gptq_g64_asym_desc_act": dict(quant_method="gptq", bits=4, group_size=64, sym=False, desc_act=True),
    "gptq_channel_v2": dict(quant_method="gptq", bits=4, group_size=-1, sym=False, desc_act=False,
                            checkpoint_format="gptq_v2"),
    "gptq8_g32": dict(quant_method="gptq", bits=8, group_size=32, sym=False, desc_act=True),
    "awq_g32": dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"),
}


def make_checkpoint(root: str, name: str, hf_model) -> tuple[str, dict]:
    """Write ``name``'s quantized checkpoint; returns (dir, {layer: reference dequantized weight})."""
    q = VARIANTS[name]
    gen = torch.Generator().manual_seed(len(name))
    tensors, ref, perms = {}, {}, {}
    for key, t in hf_model.state_dict().items():
        layer = key.rpartition(".")[0]
        if key.endswith(".weight") and layer.split(".", 3)[-1] in PROJ:
            inp = layer.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = perms.setdefault(inp, torch.randperm(t.shape[1], generator=gen))
            ref[layer] = pack_layer(tensors, layer, t, q, perm)
        else:
            tensors[key] = t.contiguous()
    path = os.path.join(root, name)
    hf_model.config.save_pretrained(path)
    add_quantization_config(path, q)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path, ref


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    root = str(tmp_path_factory.mktemp("gptq_awq"))
    return model, {name: make_checkpoint(root, name, model) for name in VARIANTS}


def _hf_greedy(model, ref: dict, prompts, n: int):
    """transformers' greedy tokens with every projection replaced by its dequantized reference."""
    import copy

    dense = copy.deepcopy(model)
    sd = dense.state_dict()
    with torch.no_grad():
        for layer, w in ref.items():
            sd[f"{layer}.weight"].copy_(w)
    out = []
    for p in prompts:
        ids = dense.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_unpacked_weights_equal_reference_dequantization(ckpts, name):
    from kvserve.model_loader.hf_loader import iterate_safetensors

    _, data = ckpts
    path, ref = data[name]
    cfg = GptqAwqConfig.from_dict(VARIANTS[name])
    layers: dict = {}
    for tname, t in iterate_safetensors(path):
        layer, _, key = tname.rpartition(".")
        if key in ("qweight", "qzeros", "scales", "g_idx"):
            layers.setdefault(layer, {})[key] = t
    assert len(layers) == 14
    permuted = 0
    for layer, t in layers.items():
        w = _to_weight(decode_layer(layer, cfg, t), cfg.bits, layer)
        gi = t.get("g_idx", torch.zeros(1))
        assert (w.perm is not None) == bool((gi[1:] < gi[:-1]).any()), layer  # sorted at load only if unsorted
        assert torch.equal(w.dequantize_unpermuted(), ref[layer]), layer
        if w.perm is not None:  # groups contiguous after the permutation
            assert torch.equal(gi[w.perm], torch.sort(gi).values)
            assert w.scale.shape[1] == w.q.shape[1] // cfg.group_size
            permuted += 1
    # desc_act permutes every layer with more than one group (g64: down_proj only; g32: all 14)
    assert permuted == {"gptq_g64_asym_desc_act": 2, "gptq8_g32": 14}.get(name, 0)


PROMPTS = [[1, 17, 200, 5, 99], [3] * 9, list(range(40, 52))]
PREFIX = list(range(100, 134))  # 34 tokens: two full 16-token blocks shared by the next two prompts


def _llm(path, **kw):
    from kvserve import LLM

    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="8MiB", max_model_len=128,
               disable_log_stats=True, **kw)


@pytest.mark.parametrize("name", ["gptq_g64_asym_desc_act", "awq_g32"])
def test_greedy_equals_transformers_on_dequantized(ckpts, name):
    from kvserve import SamplingParams

    model, data = ckpts
    path, ref = data[name]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = _llm(path)
    try:
        runner = llm.llm_engine.engine_core.model_runner
        qls = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(qls) == 8 and {m.method for m in qls} == {VARIANTS[name]["quant_method"]}
        want = _hf_greedy(model, ref, PROMPTS + [PREFIX + [7, 8], PREFIX + [9]], 8)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + [PREFIX + [7, 8]], sp, use_tqdm=False)]
        assert got == want[:4]
        hit = llm.generate([PREFIX + [9]], sp, use_tqdm=False)[0]
        assert hit.num_cached_tokens >= 32 and hit.outputs[0].token_ids == want[4]
    finally:
        llm.shutdown()


def test_autodetect_aliases_and_bad_flags(ckpts):
    from kvserve.engine.arg_utils import EngineArgs

    _, data = ckpts
    path = data["awq_g32"][0]
    cfg = EngineArgs(model=path, quantization="awq_marlin", dtype="float32").create_engine_config()
    assert cfg.model_config.quantization == "awq"
    assert EngineArgs(model=path, dtype="float32").create_engine_config().model_config.quantization == "awq"
    with pytest.raises(ValueError, match="AWQ checkpoint"):
        EngineArgs(model=path, quantization="gptq", dtype="float32").create_engine_config()


def _bad(path, name, edit):
    """A copy of checkpoint ``path`` with ``edit(tensors, config)`` applied."""
    from safetensors.torch import load_file

    out = os.path.join(os.path.dirname(path), name)
    os.makedirs(out, exist_ok=True)
    t = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    edit(t, cfg["quantization_config"])
    save_file(t, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


L0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,match", [
    (lambda t, q: t.pop(f"{L0}.qzeros"),
     r"model.layers.0.self_attn.q_proj.qzeros is missing \(expected shape \(2, 8\)\)"),
    (lambda t, q: t.__setitem__(f"{L0}.scales", t[f"{L0}.scales"][:1]),
     r"q_proj.scales has shape \(1, 64\), expected \(2, 64\)"),
    (lambda t, q: t.__setitem__(f"{L0}.g_idx", t[f"{L0}.g_idx"][:10]),
     r"q_proj.g_idx has shape \(10,\), expected \(64,\)"),
    (lambda t, q: q.__setitem__("bits", 3), "bits=3 is not supported"),
    (lambda t, q: q.__setitem__("group_size", 48), "group_size=48 is not supported"),
    (lambda t, q: q.__setitem__("checkpoint_format", "marlin"), "checkpoint_format='marlin'"),
])
def test_bad_checkpoints_are_start_up_errors(ckpts, edit, match):
    from kvserve.config import ModelConfig
    from kvserve.model_loader import get_model, load_hf_config

    _, data = ckpts
    path = _bad(data["gptq_g32_sym"][0], "bad", edit)
    with pytest.raises(ValueError, match=match):
        cfg = load_hf_config(path, "safetensors")
        get_model(ModelConfig(model=path, tokenizer=None, dtype="float32", load_format="safetensors",
                              max_model_len=64, seed=0, hf_config=cfg, quantization="gptq"), "cpu")


def test_group_size_must_divide_k():
    cfg = GptqAwqConfig.from_dict(dict(quant_method="awq", bits=4, group_size=128))
    t = {"qweight": torch.zeros(64, 8, dtype=torch.int32), "qzeros": torch.zeros(1, 8, dtype=torch.int32),
         "scales": torch.zeros(1, 64, dtype=torch.float16)}
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 64"):
        decode_layer("x.o_proj", cfg, t)


def test_row_parallel_shard_not_on_group_boundaries_is_an_error():
    """desc_act: a rank's half of K (64 of 128 features, groups of 64 scattered) holds 40 features of one
    group and 24 of the other -> a clear error instead of a wrong model."""
    g_idx = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(24, dtype=torch.long)])
    d = Decoded(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), None, g_idx)
    with pytest.raises(ValueError, match="do not hold whole quantization groups"):
        _to_weight(d, 4, "model.layers.0.self_attn.o_proj", " on tensor-parallel rank 0 of 2")


def test_tensor_parallel_2_equals_one_rank(ckpts):
    """Symmetric GPTQ g32 at TP=2 (one engine) vs transformers on the dequantized weights, which one rank
    matches: q/k/v, gate/up split by rows; o_proj (32 inputs a rank) and down_proj (64) by whole groups."""
    from kvserve import SamplingParams

    model, data = ckpts
    path, ref = data["gptq_g32_sym"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _hf_greedy(model, ref, PROMPTS, 6)  # what one rank gives (the greedy tests above)
    tp = _llm(path, tensor_parallel_size=2, device="cpu")  # gloo ranks, also on a GPU machine
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, sp, use_tqdm=False)] == want
    finally:
        tp.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["awq_g32"])
def test_kvserve_serve_answers_with_the_offline_tokens(ckpts, name, tmp_path):
    """``kvserve serve`` on a quantized checkpoint (auto-detected from config.json): the completion's
    greedy token ids equal the offline ``LLM``'s on the same checkpoint, streamed and unary."""
    import json

    import httpx

    from kvserve import SamplingParams
    from tests.utils import RemoteServer

    path = ckpts[1][name][0]
    want = [o.outputs[0].token_ids for o in _llm(path).generate(
        PROMPTS[:2],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    args = [path, "--skip-tokenizer-init", "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "128"]
    with RemoteServer.serve(args, tmp_path / "serve.log") as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        assert c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == list(want[0])
        with c.stream("POST", "/v1/completions", json=dict(body, prompt=PROMPTS[1], stream=True)) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [t for k in chunks for x in k["choices"] for t in x["token_ids"]] == list(want[1])
        assert "quantization awq" in srv.read_log()
