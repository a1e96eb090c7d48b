"""HF FP8 checkpoints (``quant_method: fp8``; ``model_loader.fp8_checkpoint``): 128 x 128 block-scaled
(DeepSeek-V3's format) and per-channel / per-tensor ``weight_scale``, written here by hand from a tiny
random Llama / DeepSeek-V2 (float8_e4m3fn weights + float32 scales, safetensors), against the same
model saved dequantized in float32.

On the CPU an FP8 checkpoint loads dequantized (same weights: equal greedy tokens); with
``KVSERVE_FP8_EMULATE=1`` its projections stay FP8 (W8A8, emulated in float32) within the bound.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from kvserve.layers.quantization import QuantizedLinear
from kvserve.model_loader import get_model, load_hf_config
from kvserve.model_loader.compressed_tensors_quant import resolve_checkpoint_quantization

CFG = dict(hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
PROMPTS = [[5, 17, 99, 3, 42], [7, 200, 13, 13, 1, 64, 250, 9]]
STEPS = 8
MODEL_BOUND = 0.2  # logits' relative L2 error of the two-layer model under W8A8 (test docstring)
# the DeepSeek-V2 shape of tests/models/test_deepseek.py, wider so projections span several 128-blocks
DS = dict(vocab_size=256, hidden_size=256, intermediate_size=320, moe_intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_group=2, topk_group=1, kv_lora_rank=32,
          qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=256,
          q_lora_rank=None, n_shared_experts=1, num_experts_per_tok=2, topk_method="greedy", norm_topk_prob=False,
          rope_parameters={"rope_type": "default", "rope_theta": 1e4}, bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _random(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _block_quant(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    wp = torch.nn.functional.pad(w.float(), (0, (-k) % b, 0, (-n) % b))
    blocks = wp.reshape(wp.shape[0] // b, b, wp.shape[1] // b, b)
    s = blocks.abs().amax((1, 3)).clamp_min(1e-12) / 448
    q = (blocks / s[:, None, :, None]).reshape(wp.shape)[:n, :k].to(torch.float8_e4m3fn)
    return q, s


def _write(root: str, name: str, hf, scheme: str) -> tuple[str, str]:
    """Quantize ``hf``'s decoder linear weights (``scheme``: block | channel) into ``root/name``; returns
    (fp8 dir, dense dir holding the exact dequantized weights). Works on the saved (published) names."""
    from safetensors.torch import load_file

    qdir, ddir = os.path.join(root, name), os.path.join(root, name + "_dense")
    hf.save_pretrained(qdir)
    hf.save_pretrained(ddir)
    out, dense = {}, {}
    for key, w in load_file(os.path.join(qdir, "model.safetensors")).items():
        dense[key] = w
        if not (key.startswith("model.layers.") and key.endswith("proj.weight") and w.dim() == 2):
            out[key] = w
            continue
        if scheme == "block":
            q, s = _block_quant(w)
            out[key], out[key + "_scale_inv"] = q, s
            n, k = w.shape
            dense[key] = q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        else:
            per_tensor = "k_proj" in key  # one scalar scale (AutoFP8's per-tensor) next to per-channel ones
            s = (w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)) / 448
            q = (w / s).to(torch.float8_e4m3fn)
            out[key], out[key[: -len("weight")] + "weight_scale"] = q, s.float().reshape(() if per_tensor else (-1, 1))
            out[key[: -len("weight")] + "input_scale"] = torch.tensor(0.05)  # static scheme: ignored
            dense[key] = q.float() * s
    cfg = json.load(open(os.path.join(qdir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8",
                                  "activation_scheme": "dynamic" if scheme == "block" else "static",
                                  **({"weight_block_size": [128, 128]} if scheme == "block" else {})}
    json.dump(cfg, open(os.path.join(qdir, "config.json"), "w"))
    save_file(out, os.path.join(qdir, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(ddir, "model.safetensors"))
    return qdir, ddir


_GREEDY: dict = {}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8ckpt"))
    torch.manual_seed(0)
    out = {s: _write(root, f"llama_{s}", _random(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))), s)
           for s in ("block", "channel")}
    torch.manual_seed(0)
    ds_cfg = transformers.DeepseekV2Config(**DS)
    ds_cfg._attn_implementation = "eager"
    out["deepseek"] = _write(root, "deepseek_block", _random(transformers.AutoModelForCausalLM.from_config(ds_cfg)),
                             "block")
    return out


def _greedy(path: str, cache: bool = False) -> tuple[list[list[int]], torch.nn.Module]:
    """Greedy tokens of ``PROMPTS`` and the engine's model (``cache``: once per path in this module)."""
    if cache and path in _GREEDY:
        return _GREEDY[path]
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=64, cpu_threads=1,
              disable_log_stats=True, num_gpu_blocks_override=16, device="cpu")  # CPU rules also on a GPU host
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    res = [o.outputs[0].token_ids for o in outs], llm.llm_engine.engine_core.model_runner.model
    if cache:
        _GREEDY[path] = res
    return res


@pytest.mark.parametrize("name", ["block", "deepseek"])
def test_block_checkpoint_on_cpu_is_dequantized_exactly(ckpts, name):
    qdir, ddir = ckpts[name]
    got, model = _greedy(qdir)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    ref, _ = _greedy(ddir, cache=True)
    assert got == ref


def _mc(path, quantization):
    return ModelConfig(model=path, tokenizer=None, dtype="float32", load_format="safetensors", max_model_len=64,
                       seed=0, hf_config=load_hf_config(path, "safetensors"), quantization=quantization)


@pytest.mark.parametrize("name", ["block", "channel"])
def test_kept_fp8_llama_greedy_within_bound(ckpts, name, monkeypatch):
    """FP8 kept (emulated W8A8; the norm emits the per-token FP8 input): every projection swapped, logits
    close to the dequantized model's, and each greedy token the dense model's choice or within the bound.

    Bound: each GEMM's W8A8 error is ~3.6% of its output (e4m3's uniform 2^-4 relative rounding of the
    activations, ``fp8_w8a8``); the 8 GEMMs of the two layers add it in quadrature, ~10% of the logits,
    so the logits' relative L2 error is held under ``MODEL_BOUND`` (0.2), and a greedy token may differ
    from the dense argmax only where the dense logits' gap to it is below ``3 * MODEL_BOUND`` of the
    row's RMS (teacher-forced on the FP8 engine's own tokens)."""
    from tests.model_loader.test_compressed_tensors import _prefill_logits

    monkeypatch.setenv("KVSERVE_FP8_EMULATE", "1")
    qdir, ddir = ckpts[name]
    got, model = _greedy(qdir)
    qls = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(qls) == 8 and {m.method for m in qls} == {"fp8_block" if name == "block" else "fp8"}
    assert (model.model.layers[0].input_layernorm.fp8_out_min_m == 0) == (name == "channel")
    ref, dense = _greedy(ddir, cache=True)
    cfg = load_hf_config(qdir, "safetensors")
    ids = torch.tensor(PROMPTS[1])
    fp8 = get_model(_mc(qdir, "fp8"), "cpu")
    a, b = _prefill_logits(fp8, cfg, ids), _prefill_logits(dense, cfg, ids)
    rel = ((a - b).norm() / b.norm()).item()
    assert 0 < rel < MODEL_BOUND, rel
    assert [g[0] for g in got] == [r[0] for r in ref]
    for prompt, toks in zip(PROMPTS, got):
        seq = torch.tensor(prompt + toks[:-1])
        lg = _prefill_logits(dense, cfg, seq)[len(prompt) - 1:]
        gap = lg.max(-1).values - lg[torch.arange(len(toks)), torch.tensor(toks)]
        assert (gap <= 3 * MODEL_BOUND * lg.pow(2).mean(-1).sqrt()).all(), (gap, toks)
    if name == "channel":  # the norm-fused input and the linear's own quantization: the same numerics
        monkeypatch.setenv("KVSERVE_FP8_NORM_QUANT", "0")
        unfused = get_model(_mc(qdir, "fp8"), "cpu")
        assert unfused.model.layers[0].input_layernorm.fp8_out_min_m is None
        assert torch.equal(_prefill_logits(unfused, cfg, ids), a)


def test_deepseek_kept_fp8_projections(ckpts, monkeypatch):
    monkeypatch.setenv("KVSERVE_FP8_EMULATE", "1")
    qdir, ddir = ckpts["deepseek"]
    model = get_model(_mc(qdir, "fp8"), "cpu")
    kinds = {type(m).__name__ + ":" + getattr(m, "method", "") for m in model.modules()
             if isinstance(m, QuantizedLinear)}
    assert kinds == {"QuantizedLinear:fp8_block"}  # o_proj, the dense / shared MLPs; MLA and experts dequantized
    got, _ = _greedy(qdir)
    ref, _ = _greedy(ddir, cache=True)
    agree = sum(a == b for ga, gb in zip(got, ref) for a, b in zip(ga, gb)) / sum(map(len, ref))
    assert agree >= 0.75, (got, ref)


def test_resolution_and_bad_checkpoints(ckpts, tmp_path, monkeypatch):
    qdir, _ = ckpts["block"]
    cfg = load_hf_config(qdir, "safetensors")
    assert resolve_checkpoint_quantization(None, cfg, "safetensors", qdir, device="cpu") == (None, [])
    assert resolve_checkpoint_quantization(None, cfg, "safetensors", qdir, device="cuda") == ("fp8", ["fp8"])
    with pytest.raises(ValueError, match="FP8 checkpoint.*--quantization int8"):
        resolve_checkpoint_quantization("int8", cfg, "safetensors", qdir, device="cuda")
    monkeypatch.setenv("KVSERVE_FP8_EMULATE", "1")
    assert resolve_checkpoint_quantization(None, cfg, "safetensors", qdir, device="cpu") == ("fp8", ["fp8"])
    # a scale grid that does not cover its weight, and a weight without its scale
    from safetensors.torch import load_file

    sd = load_file(os.path.join(qdir, "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight_scale_inv"
    for edit, match in ((lambda d: d.__setitem__(key, d[key][:, :1].contiguous()), r"down_proj.*\(2, 3\)"),
                        (lambda d: d.pop(key), "down_proj.weight has no weight_scale_inv")):
        bad = tmp_path / f"bad{len(match)}"
        bad.mkdir()
        d = dict(sd)
        edit(d)
        save_file(d, str(bad / "model.safetensors"))
        json.dump(json.load(open(os.path.join(qdir, "config.json"))), open(bad / "config.json", "w"))
        with pytest.raises(ValueError, match=match):
            get_model(_mc(str(bad), "fp8"), "cpu")
    bad_cfg = transformers.LlamaConfig(**CFG, quantization_config={"quant_method": "fp8", "activation_scheme": "none"})
    with pytest.raises(ValueError, match="activation_scheme"):
        resolve_checkpoint_quantization(None, bad_cfg, "safetensors", device="cuda")
