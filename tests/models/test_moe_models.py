"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) vs HF transformers, tensor and
expert parallelism, and the start-up errors of bad MoE configs and checkpoints.

Tiny random configs written by transformers (float32, weights at std 0.08); greedy tokens must
equal transformers' over 24 tokens, batched, with chunked prefill (16-token budget) and a second
round of prompts that hit the prefix cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve import LLM, SamplingParams

TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)
PREFIX = list(range(60, 100))  # 40 tokens: 5 blocks of 8 shared by the second round
ROUND1 = [list(range(1, 13)), [5] * 20, PREFIX + [7, 8, 9]]
ROUND2 = [PREFIX + [11], PREFIX + list(range(120, 137))]


def _config(arch: str, **kw):
    import transformers

    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers): the LlamaMLP path
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                          mlp_only_layers=[1])
    elif arch == "qwen2_moe":  # norm_topk_prob false (the default), q/k/v bias, gated shared expert
        cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    else:
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def hf_greedy(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at each of ``tokens``' positions, teacher-forced in one
    forward over ``prompt + tokens[:-1]``: equal to ``tokens`` iff ``tokens`` is HF's greedy output."""
    x = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_checkpoint(request, tmp_path_factory):
    """(arch, checkpoint dir, HF model, the checkpoint's tensors by their published names)."""
    from transformers import AutoModelForCausalLM

    from kvserve.model_loader.hf_loader import iterate_safetensors

    arch = request.param
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 or p.abs().sum() == 0:  # matrices, and biases (zero-initialized)
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return arch, str(path), model, dict(iterate_safetensors(str(path)))


def _llm(path, **kw):
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
               block_size=8, max_num_batched_tokens=16, disable_log_stats=True, **kw)


def test_greedy_equals_transformers_batched_chunked_and_prefix_cached(moe_checkpoint):
    arch, path, hf, _ = moe_checkpoint
    llm = _llm(path)
    try:
        for p, o in zip(ROUND1, llm.generate(ROUND1, GREEDY, use_tqdm=False)):
            assert len(o.outputs[0].token_ids) == TOKENS
            assert o.outputs[0].token_ids == hf_greedy(hf, p, o.outputs[0].token_ids)
        outs = llm.generate(ROUND2, GREEDY, use_tqdm=False)
        for p, o in zip(ROUND2, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, o.outputs[0].token_ids)
        assert all(o.num_cached_tokens >= 32 for o in outs)  # the shared 40-token prefix: 4+ blocks of 8
        s = llm.llm_engine.stats
        from kvserve.models.moe_stats import expert_token_counts

        counts = expert_token_counts(llm.llm_engine.engine_core.model_runner.model)
        if not torch.cuda.is_available():  # read back with the step outputs (on a GPU at most once a second)
            assert s.moe_expert_tokens == counts
        # each request's last token is sampled, never run through the model
        computed = s.num_prompt_tokens + s.num_generation_tokens - len(ROUND1) - len(ROUND2)
        moe_layers = 1 if arch == "qwen3_moe" else 2
        assert sum(counts) == 2 * moe_layers * computed  # top-2 per token per MoE layer
    finally:
        llm.shutdown()


def _load_into(arch, state):
    """Build the kvserve model for ``arch`` on the CPU and load ``state`` (HF names)."""
    from kvserve.models.registry import get_model_class

    cfg = _config(arch)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    model = get_model_class(cfg)(cfg, torch.float32, max_model_len=128)
    model.load_weights(state.items())
    return model


def test_missing_misshaped_and_unknown_expert_tensors_are_named(moe_checkpoint):
    arch, _, _, state = moe_checkpoint
    mlp = "block_sparse_moe" if arch == "mixtral" else "mlp"
    up = "w3" if arch == "mixtral" else "up_proj"
    name = f"model.layers.0.{mlp}.experts.1.{up}.weight"
    _load_into(arch, state)  # the full checkpoint loads
    partial = {k: v for k, v in state.items() if k != name}
    with pytest.raises(ValueError, match=rf"missing expert weight '{name}' \(expected shape \(32, 64\)\)"):
        _load_into(arch, partial)
    bad = dict(state, **{name: torch.zeros(31, 64)})
    with pytest.raises(ValueError, match=rf"'{name}'.*checkpoint shape \(31, 64\), expected \(32, 64\)"):
        _load_into(arch, bad)
    extra = dict(state, **{f"model.layers.0.{mlp}.experts.9.{up}.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match="expert 9 out of range"):
        _load_into(arch, extra)
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.mlp.router.weight'"):
        _load_into(arch, dict(state, **{"model.layers.0.mlp.router.weight": torch.zeros(4, 64)}))


def test_stacked_expert_tensors_load_like_per_expert_ones():
    """transformers 5's in-memory layout (``experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    torch.manual_seed(1)
    from kvserve.models.registry import get_model_class

    cfg = _config("qwen3_moe")
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    ref = get_model_class(cfg)(cfg, torch.float32)
    state = {}
    for n, p in ref.named_parameters():
        p.data.normal_()
    for n, p in ref.named_parameters():
        hf = n.replace("qkv_proj", "QKV").replace("gate_up_proj", "GU")
        if ".experts.w13" in n:
            state[n.replace("w13", "gate_up_proj")] = p.data.clone()
        elif ".experts.w2" in n:
            state[n.replace("w2", "down_proj")] = p.data.clone()
        elif "QKV" in hf:
            q, k, v = p.data.split([64, 32, 32])
            for nm, t in zip("qkv", (q, k, v)):
                state[hf.replace("QKV", f"{nm}_proj")] = t.clone()
        elif "GU" in hf:
            g, u = p.data.chunk(2)
            state[hf.replace("GU", "gate_proj")], state[hf.replace("GU", "up_proj")] = g.clone(), u.clone()
        else:
            state[n] = p.data.clone()
    model = get_model_class(cfg)(cfg, torch.float32)
    model.load_weights(state.items())
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("arch,field,value,match", [
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok 9 must be between 1 and the number of experts"),
    ("qwen2_moe", "num_experts_per_tok", 9, "num_experts_per_tok 9"),
    ("mixtral", "num_experts_per_tok", 5, "num_experts_per_tok 5 must be between 1 and the number of experts \\(4\\)"),
    ("mixtral", "hidden_act", "gelu", "hidden_act 'gelu'"),
    ("qwen3_moe", "scoring_func", "sigmoid", "scoring_func='sigmoid' is not implemented"),
    ("qwen2_moe", "n_group", 4, "n_group=4 is not implemented"),
    ("mixtral", "routed_scaling_factor", 2.5, "routed_scaling_factor=2.5"),
    ("qwen3_moe", "moe_layer_freq", 2, "moe_layer_freq=2"),
    ("qwen3_moe", "moe_topk_method", "noaux", "moe_topk_method='noaux' is not implemented"),
    ("qwen3_moe", "decoder_sparse_step", 0, "decoder_sparse_step must be >= 1"),
    ("qwen3_moe", "attention_bias", True, "attention_bias"),
])
def test_bad_moe_configs_are_startup_errors(arch, field, value, match):
    from kvserve.models.registry import validate_model_config

    cfg = _config(arch, **{field: value})
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    with pytest.raises(ValueError, match=match):
        validate_model_config(cfg, 128)


def test_training_only_fields_are_accepted():
    from kvserve.models.registry import validate_model_config

    cfg = _config("mixtral", router_jitter_noise=0.1, output_router_logits=True, router_aux_loss_coef=0.02)
    cfg.architectures = ["MixtralForCausalLM"]
    validate_model_config(cfg, 128)


def test_parallel_split_checks():
    from kvserve.engine.arg_utils import check_tensor_parallel

    cfg = _config("qwen2_moe", num_experts=6, num_attention_heads=4, num_key_value_heads=2)
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    check_tensor_parallel(cfg, 2, "cpu", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="6 experts are not divisible by the expert-parallel size 4"):
        check_tensor_parallel(cfg, 4, "cpu", enable_expert_parallel=True)
    cfg = _config("mixtral", intermediate_size=30)
    cfg.architectures = ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match="must divide"):
        check_tensor_parallel(cfg, 4, "cpu")
    cfg = _config("qwen2_moe", shared_expert_intermediate_size=50)
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    with pytest.raises(ValueError, match="shared_expert_intermediate_size 50"):
        check_tensor_parallel(cfg, 4, "cpu")


def test_parameter_counts_total_and_active():
    from transformers import AutoModelForCausalLM

    from kvserve.models.moe_stats import parameter_counts
    from kvserve.models.registry import get_model_class

    cfg = _config("qwen2_moe")
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, torch.float32)
    total, active = parameter_counts(model)
    assert total == sum(p.numel() for p in hf.parameters())
    per_expert = 3 * 64 * 32
    assert total - active == 2 * (8 - 2) * per_expert  # two MoE layers, 6 experts idle per token


@pytest.mark.slow  # two worker processes per engine (gloo, mp executor)
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_tensor_and_expert_parallel_2_equal_one_rank(moe_checkpoint, ep):
    arch, path, hf, _ = moe_checkpoint
    if arch != "qwen2_moe":  # shared expert + routed experts: the partial sums before one all-reduce
        pytest.skip("one architecture covers both layouts")
    llm = _llm(path, tensor_parallel_size=2, enable_expert_parallel=ep)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(ROUND1, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    for p, toks in zip(ROUND1, got):
        assert toks == hf_greedy(hf, p, toks)


def test_expert_load_metrics():
    """``/metrics``: cumulative per-expert counts from the stats message become counter deltas,
    and the imbalance gauge is max / mean over the tokens routed since the previous update."""
    pytest.importorskip("prometheus_client")
    from kvserve.engine.ipc import SchedulerStatsMsg
    from kvserve.metrics.prometheus import PrometheusStatLogger

    m = PrometheusStatLogger("m")
    m.on_step(SchedulerStatsMsg(moe_expert_tokens=[4, 4, 4, 4]), 8, 0)
    m.on_step(SchedulerStatsMsg(), 0, 1)  # a step without a read changes nothing
    m.on_step(SchedulerStatsMsg(moe_expert_tokens=[10, 4, 5, 5]), 0, 1)
    t = m.render().decode()
    assert 'kvserve:moe_expert_tokens_total{expert="0",model_name="m"} 10.0' in t
    assert 'kvserve:moe_expert_tokens_total{expert="3",model_name="m"} 5.0' in t
    assert 'kvserve:moe_expert_load_imbalance{model_name="m"} 3.0' in t  # deltas [6, 0, 1, 1]: 6 / 2


def test_expert_parallel_flag_is_ignored_for_a_dense_model():
    import logging

    from transformers import LlamaConfig

    from kvserve.engine.arg_utils import check_tensor_parallel

    cfg = LlamaConfig(**COMMON, intermediate_size=96, architectures=["LlamaForCausalLM"])
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("kvserve")  # kvserve's logger may not propagate (setup_logging)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        check_tensor_parallel(cfg, 2, "cpu", enable_expert_parallel=True)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert any("LlamaForCausalLM has no experts; ignored" in m for m in seen)


def _write_gguf(arch: str, cfg, state: dict, path: str) -> None:
    """A float32 GGUF with llama.cpp's names: experts stacked ``[E, ...]`` (``ffn_*_exps``), the
    router ``ffn_gate_inp``; Mixtral as ``llama`` with ``expert_count`` (q/k rows permuted)."""
    import re

    import gguf
    import numpy as np

    llama = arch == "mixtral"
    w = gguf.GGUFWriter(path, "llama" if llama else "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_local_experts if llama else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not llama:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    experts: dict[tuple, dict] = {}
    for name, t in state.items():
        t = t.float()
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(m.group(3), "down")
            experts.setdefault((int(m.group(1)), kind), {})[int(m.group(2))] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.*)\.weight$", name)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        elif m.group(2) in ("mlp.gate", "block_sparse_moe.gate"):
            out = f"blk.{m.group(1)}.ffn_gate_inp.weight"
        else:
            out = f"blk.{m.group(1)}.{names[m.group(2)]}.weight"
            if llama and m.group(2) in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's rope row order
                n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                t = t.reshape(n, 2, t.shape[0] // n // 2, -1).transpose(1, 2).reshape(t.shape)
        w.add_tensor(out, t.numpy())
    for (layer, kind), per in experts.items():
        w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", np.stack([per[e].numpy() for e in sorted(per)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_with_llama_cpp_moe_names_equals_transformers(moe_checkpoint, tmp_path, monkeypatch):
    arch, path, hf, state = moe_checkpoint
    if arch == "qwen2_moe":
        pytest.skip("Qwen3-MoE (qwen3moe) and Mixtral (llama + expert_count) cover the GGUF names")
    pytest.importorskip("gguf")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    if arch == "qwen3_moe":  # llama.cpp's qwen3moe has no mlp_only_layers: every layer sparse
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(_config(arch, mlp_only_layers=[]), dtype=torch.float32).eval()
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.08)
        hf.save_pretrained(tmp_path / "hf")
        from kvserve.model_loader.hf_loader import iterate_safetensors

        state = dict(iterate_safetensors(str(tmp_path / "hf")))
    file = str(tmp_path / f"{arch}.gguf")
    _write_gguf(arch, hf.config, state, file)
    llm = LLM(model=file, skip_tokenizer_init=True, dtype="float32", max_model_len=128, kv_cache_memory="4MiB",
              disable_log_stats=True)
    try:
        assert type(llm.llm_engine.engine_core.model_runner.model).__name__ == hf.config.architectures[0]
        outs = llm.generate(ROUND1[:2], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for p, o in zip(ROUND1, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, o.outputs[0].token_ids)
