"""GPTQ and AWQ mixture-of-experts checkpoints (``model_loader.gptq_awq`` experts -> ``GroupQuantExperts``).

A tiny random Qwen3-MoE written by transformers is quantized here: the attention projections and every
expert's gate/up/down projection (stored per expert, ``mlp.experts.{e}.gate_proj.qweight`` ..., as
GPTQModel / AutoGPTQ and AutoAWQ write MoE checkpoints; the router ``mlp.gate`` stays dense, as those
tools leave it), packed with ``gptq_packing``'s packers (its docstring gives the formats and their
sources). kvserve's greedy tokens, batched, must equal transformers' on the dequantized dense model
(float32). Tensor / expert parallel slices of the packed experts sum to the whole layer; bad expert
tensors are start-up errors naming the tensor and shape.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kvserve.distributed import parallel_state
from kvserve.layers.moe import FusedMoE, fused_experts_torch
from kvserve.model_loader.gptq_awq import GptqAwqConfig, GptqAwqLoader
from tests.model_loader.gptq_packing import add_quantization_config, pack_layer

VARIANTS = {
    "gptq_g32_sym": dict(quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False),
    "gptq_g32_asym_desc_act": dict(quant_method="gptq", bits=4, group_size=32, sym=False, desc_act=True),
    "awq_g32": dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"),
}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = [list(range(1, 13)), [5] * 20, list(range(60, 90))]
TOKENS = 8


def _pack(layer: str, w: torch.Tensor, q: dict, tensors: dict, perm=None) -> torch.Tensor:
    """Quantize ``w [N, K]`` into ``tensors`` under ``layer`` in ``q``'s format (``perm``: the activation order
    with ``desc_act``); returns the dequantized weight."""
    if perm is None:
        perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[0] + len(layer)))
    return pack_layer(tensors, layer, w, q, perm)


def _expert_tensors(prefix: str, gate_up: torch.Tensor, down: torch.Tensor, q: dict, tensors: dict):
    """Stacked ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` -> per-expert quantized tensors; the dequantized stacks."""
    i = down.shape[2]
    dq_gu, dq_d = torch.empty_like(gate_up), torch.empty_like(down)
    for e in range(gate_up.shape[0]):
        perm = torch.randperm(gate_up.shape[2], generator=torch.Generator().manual_seed(e))  # gate and up share it
        dq_gu[e, :i] = _pack(f"{prefix}.{e}.gate_proj", gate_up[e, :i], q, tensors, perm)
        dq_gu[e, i:] = _pack(f"{prefix}.{e}.up_proj", gate_up[e, i:], q, tensors, perm)
        dq_d[e] = _pack(f"{prefix}.{e}.down_proj", down[e], q, tensors)
    return dq_gu, dq_d


def make_checkpoint(root: str, name: str, hf_model) -> tuple[str, nn.Module]:
    """Write ``name``'s checkpoint; returns (dir, the HF model with the dequantized weights)."""
    q = VARIANTS[name]
    ref = copy.deepcopy(hf_model)
    sd = ref.state_dict()
    tensors = {}
    perms = {}  # desc_act: projections reading the same input (q/k/v) share GPTQ's activation order
    for key, t in hf_model.state_dict().items():
        layer = key.rpartition(".")[0]
        if key.endswith(".weight") and layer.rpartition(".")[2] in ATTN:
            inp = layer.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            gen = torch.Generator().manual_seed(len(perms))
            perm = perms.setdefault(inp, torch.randperm(t.shape[1], generator=gen))
            sd[key].copy_(_pack(layer, t, q, tensors, perm))
        elif key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.rpartition(".")[0]
            dq_gu, dq_d = _expert_tensors(prefix, t, hf_model.state_dict()[f"{prefix}.down_proj"], q, tensors)
            sd[key].copy_(dq_gu)
            sd[f"{prefix}.down_proj"].copy_(dq_d)
        elif not key.endswith("mlp.experts.down_proj"):
            tensors[key] = t.contiguous()
    path = os.path.join(root, name)
    hf_model.config.save_pretrained(path)
    add_quantization_config(path, q)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path, ref


@pytest.fixture(scope="module")
def hf_moe():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, intermediate_size=96,
                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_equals_transformers_on_dequantized(hf_moe, tmp_path, name):
    from kvserve import LLM, SamplingParams
    from kvserve.layers.moe.group_quant_experts import GroupQuantExperts

    path, ref = make_checkpoint(str(tmp_path), name, hf_moe)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              block_size=8, max_num_batched_tokens=32, disable_log_stats=True)
    try:
        model = llm.llm_engine.engine_core.model_runner.model
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert len(moes) == 2 and all(isinstance(m.w13_quant, GroupQuantExperts) and m.w13.numel() == 0
                                      for m in moes)
        assert (moes[0].w13_quant.zeros is None) == VARIANTS[name].get("sym", False)
        assert (moes[0].w13_quant.perm is not None) == VARIANTS[name].get("desc_act", False)  # gate/up: 2 groups
        sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert got == [_hf_greedy(ref, p, TOKENS) for p in PROMPTS]
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- loader alone, one MoE layer

E, H, I = 4, 64, 64
PREFIX = "model.layers.0.mlp.experts"


def _layer_checkpoint(q: dict, seed: int = 0, i: int = I):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(E, 2 * i, H, generator=g) * 0.1, torch.randn(E, H, i, generator=g) * 0.1
    tensors = {}
    dq_gu, dq_d = _expert_tensors(PREFIX, gate_up, down, q, tensors)
    return tensors, dq_gu, dq_d


def _loaded_layer(q: dict, tensors: dict, i: int = I) -> FusedMoE:
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mlp = nn.Module()
    root.model.layers[0].mlp.experts = moe = FusedMoE(E, 2, H, i, dtype=torch.float32)
    ga = GptqAwqLoader(root, GptqAwqConfig.from_dict(q))
    loaded = dict(ga.filter(tensors.items()))  # placeholders of the quantized projections, dense tensors
    assert all(t.stride() == (0, 0) for n, t in loaded.items() if f"{n[:-7]}.qweight" in tensors)
    assert ga.apply(root, torch.float32) == 1
    return moe


@pytest.mark.parametrize("ep", [False, True])
def test_tensor_and_expert_parallel_slices_sum_to_the_layer(monkeypatch, ep):
    """Two ranks (I split at 32 = one group of 32 per rank; or experts 0-1 / 2-3): their partial outputs
    sum to the whole dequantized layer. 8-bit GPTQ, asymmetric."""
    q = dict(quant_method="gptq", bits=8, group_size=32, sym=False, desc_act=False)
    tensors, dq_gu, dq_d = _layer_checkpoint(q)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, H, generator=g)
    logits = torch.randn(7, E, generator=g)
    total = torch.zeros(7, H)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_RANK", rank)
        monkeypatch.setattr(parallel_state, "_SIZE", 2)
        monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", ep)
        moe = _loaded_layer(q, tensors)
        moe.reduce_results = False
        total += moe(x, logits)
    w, ids = moe.select(logits)
    torch.testing.assert_close(total, fused_experts_torch(x, dq_gu, dq_d, w, ids), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_slice_off_group_boundaries_is_an_error(monkeypatch):
    """I = 96 in groups of 32 over 2 ranks: each rank's 48 down_proj inputs hold one whole group and half
    of another -> a start-up error instead of a wrong model."""
    q = dict(quant_method="gptq", bits=4, group_size=32, sym=True, desc_act=False)
    tensors, _, _ = _layer_checkpoint(q, i=96)
    monkeypatch.setattr(parallel_state, "_RANK", 0)
    monkeypatch.setattr(parallel_state, "_SIZE", 2)
    with pytest.raises(ValueError, match=r"experts.0.down_proj: its input features on tensor-parallel rank 0 of 2 "
                                         r"do not hold whole quantization groups"):
        _loaded_layer(q, tensors, i=96)


def test_expert_activation_orders(monkeypatch):
    """desc_act: every expert's g_idx in its own order (gate and up sharing one): the layer equals the dense
    dequantized one. Gate and up with different orders are refused."""
    q = dict(quant_method="gptq", bits=4, group_size=32, sym=False, desc_act=True)
    tensors, dq_gu, dq_d = _layer_checkpoint(q)
    moe = _loaded_layer(q, tensors)
    assert moe.w13_quant.perm is not None and moe.w2_quant.perm is not None
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    w, ids = moe.select(logits)
    torch.testing.assert_close(moe(x, logits), fused_experts_torch(x, dq_gu, dq_d, w, ids), rtol=1e-5, atol=1e-5)
    bad = dict(tensors)
    bad[f"{PREFIX}.1.up_proj.g_idx"] = torch.arange(H, dtype=torch.int32).flip(0) // 32
    with pytest.raises(ValueError, match=r"experts.1.up_proj and .*experts.1.gate_proj are fused .* different g_idx"):
        _loaded_layer(q, bad)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(f"{PREFIX}.1.up_proj.scales"),
     r"model.layers.0.mlp.experts.1.up_proj.scales is missing"),
    (lambda t: t.__setitem__(f"{PREFIX}.0.down_proj.qzeros", t[f"{PREFIX}.0.down_proj.qzeros"][:1]),
     r"experts.0.down_proj.qzeros has shape \(1, 8\), expected \(2, 8\)"),
    (lambda t: [t.__setitem__(f"{PREFIX}.2.gate_proj.{k}", t[f"{PREFIX}.2.gate_proj.{k}"][:, :n])
                for k, n in (("qweight", 32), ("qzeros", 4), ("scales", 32))],
     r"experts.2.gate_proj is \(32, 64\) \(out, in features\), expected \(64, 64\)"),
    (lambda t: [t.pop(f"{PREFIX}.3.down_proj.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")]
     + [t.__setitem__(f"{PREFIX}.3.down_proj.weight", torch.zeros(H, I))],  # one expert stored dense
     r"expert 3 w2 is not stored quantized .* qweight of shape \(8, 64\)"),
])
def test_bad_expert_tensors_are_start_up_errors(edit, match):
    q = VARIANTS["gptq_g32_sym"]
    tensors, _, _ = _layer_checkpoint(q)
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        _loaded_layer(q, tensors)


def test_dummy_gptq_layout_packs_the_experts(hf_moe, tmp_path):
    """``--load-format dummy --quantization gptq`` (benchmarks): the random experts quantized at load and
    kept packed; the layer equals the torch loop over its dequantized experts."""
    from kvserve.config import ModelConfig
    from kvserve.model_loader import get_model, load_hf_config

    hf_moe.config.save_pretrained(tmp_path)
    cfg = load_hf_config(str(tmp_path), "dummy")
    model = get_model(ModelConfig(model=str(tmp_path), tokenizer=None, dtype="float32", load_format="dummy",
                                  max_model_len=64, seed=0, hf_config=cfg, quantization="gptq"), "cpu")
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(m.quant_method == "gptq" and m.w13_quant.zeros is None for m in moes)
    q13, q2 = moes[0].w13_quant, moes[0].w2_quant
    assert q13.shape == (4, 64, 64) and q2.shape == (4, 64, 32) and q13.bits == 4
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(3, 64, generator=g), torch.randn(3, 4, generator=g)
    w, ids = moes[0].select(logits)
    d13 = torch.stack([q13.dequantize(e) for e in range(4)])
    d2 = torch.stack([q2.dequantize(e) for e in range(4)])
    torch.testing.assert_close(moes[0](x, logits), fused_experts_torch(x, d13, d2, w, ids))


def test_gptq_dynamic_exclusions_accepted_overrides_refused():
    base = dict(quant_method="gptq", bits=4, group_size=128, sym=True)
    GptqAwqConfig.from_dict(dict(base, dynamic={"-:.*mlp\\.gate$": {}}))  # excluded modules: stored dense
    with pytest.raises(ValueError, match=r"dynamic overrides \['\+:.*down_proj'\] are not supported"):
        GptqAwqConfig.from_dict(dict(base, dynamic={"+:.*down_proj": {"bits": 8}}))


def test_quantized_shared_expert_stays_a_partial_sum_under_tensor_parallel(monkeypatch):
    """Qwen2-MoE's shared expert under tensor parallelism: its (GPTQ) down_proj shard's product is returned
    unreduced (the MoE block all-reduces the shared and routed partial sums once)."""
    from kvserve.layers.quantization import QuantizedLinear
    from kvserve.layers.quantization.group_quant import PackedGroupQuant, quantize_groupwise
    from kvserve.models import qwen_moe

    mlp = qwen_moe.SharedExpertMLP(32, 64, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(128, 32, generator=g) * 0.1)
    w = quantize_groupwise(torch.randn(32, 64, generator=g) * 0.1, 4, 32, True)
    mlp.down_proj = QuantizedLinear("gptq", PackedGroupQuant(w, torch.device("cpu"), torch.float32), 64, 32, None,
                                    tp_reduce=True)
    monkeypatch.setattr(qwen_moe, "get_tp_size", lambda: 2)  # no process group: an all-reduce here would fail
    x = torch.randn(3, 32, generator=g)
    h = mlp.act(mlp.gate_up_proj(x))
    torch.testing.assert_close(mlp(x), h @ w.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_mixtral_expert_names():
    """Mixtral's ``block_sparse_moe.experts.{e}.w1|w3|w2`` (AWQ) load into the model's ``mlp.experts``."""
    q = VARIANTS["awq_g32"]
    tensors, dq_gu, dq_d = _layer_checkpoint(q)
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    renamed = {}
    for key, t in tensors.items():
        layer, _, kind = key.rpartition(".")
        prefix, _, proj = layer.rpartition(".")
        renamed[f"{prefix.replace('.mlp.', '.block_sparse_moe.')}.{names[proj]}.{kind}"] = t
    root = nn.Module()
    root.hf_mlp_name = "block_sparse_moe"
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    root.model.layers[0].mlp = nn.Module()
    root.model.layers[0].mlp.experts = moe = FusedMoE(E, 2, H, I, dtype=torch.float32)
    ga = GptqAwqLoader(root, GptqAwqConfig.from_dict(q))
    assert sorted(dict(ga.filter(renamed.items()))) == sorted(
        f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight" for e in range(E) for p in ("w1", "w3", "w2"))
    assert ga.apply(root, torch.float32) == 1
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(4, H, generator=g), torch.randn(4, E, generator=g)
    w, ids = moe.select(logits)
    torch.testing.assert_close(moe(x, logits), fused_experts_torch(x, dq_gu, dq_d, w, ids), rtol=1e-5, atol=1e-5)
