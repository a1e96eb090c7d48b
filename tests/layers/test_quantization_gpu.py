"""Quantized linear layers on CUDA (int4 tinygemm, int8, fp8 ``_scaled_mm``) vs dequantized references."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.quantization import QuantizedLinear
from kvserve.layers.quantization.fp8_w8a8 import W8A8_MIN_M
from kvserve.layers.quantization.kernels import FP8_MAX, quantize_fp8, quantize_int4, quantize_int8

pytestmark = pytest.mark.gpu
SHAPES = [(16, 128), (7, 33), (100, 100), (1024, 4096), (4096, 14336)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 33])
def test_cuda_formats_match_dequantized(n, k, m):
    torch.manual_seed(n + k + m)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = lin.weight.detach().float()
    b = lin.bias.detach().float()
    # int4: the reference uses the same group size the layer picked
    q4 = QuantizedLinear.from_dense(lin, "int4", torch.bfloat16)
    g = q4.packed.group_size
    ref4 = quantize_int4(torch.nn.functional.pad(w, (0, (-k) % g)), g).dequantize()[:, :k]
    assert _rel(q4(x), x.float() @ ref4.T + b) < 2e-2
    q8, s8 = quantize_int8(w)
    assert _rel(QuantizedLinear.from_dense(lin, "int8", torch.bfloat16)(x), x.float() @ (q8.float() * s8[:, None]).T + b) < 2e-2
    if torch.cuda.get_device_capability() >= (8, 9):
        qf, sf = quantize_fp8(w)
        layer = QuantizedLinear.from_dense(lin, "fp8", torch.bfloat16)
        xq = x.float()
        if not (layer.packed.triton and m <= W8A8_MIN_M):  # _scaled_mm path: activations quantized per token
            xs = x.float().abs().amax(1, keepdim=True) / FP8_MAX
            xq = (x.float() / xs).to(torch.float8_e4m3fn).float() * xs
        ref = xq @ (qf.float() * sf[:, None]).T + b
        assert _rel(layer(x), ref) < 2e-2


def test_small_llama_quantized_generates_on_cuda(tmp_path):
    from transformers import LlamaConfig

    from kvserve import LLM, SamplingParams

    LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained(tmp_path)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for method in ("int4", "int8", "fp8"):
        if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
            continue
        llm = LLM(model=str(tmp_path), load_format="dummy", dtype="bfloat16", quantization=method,
                  skip_tokenizer_init=True, kv_cache_memory="64MiB", max_model_len=128, disable_log_stats=True)
        out = llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        del llm


@pytest.mark.parametrize("group_size,sym", [(128, False), (32, True), (-1, False)])
@pytest.mark.parametrize("kernel", ["tinygemm", "w4a16"])
def test_gptq_awq_weights_on_cuda_match_dequantized(group_size, sym, kernel, monkeypatch):
    """GPTQ / AWQ 4-bit weights (``w = (q - z) * s``) on both CUDA kernels, bf16, M = 1 and 33."""
    from kvserve.layers.quantization.group_quant import PackedGroupQuant, quantize_groupwise

    monkeypatch.setenv("KVSERVE_INT4_KERNEL", kernel)
    torch.manual_seed(group_size + sym)
    w = torch.randn(256, 512) * 0.05
    gq = quantize_groupwise(w, 4, group_size, sym)
    packed = PackedGroupQuant(gq, torch.device("cuda"), torch.bfloat16)
    assert packed.cuda_triton == (kernel == "w4a16")
    ref = gq.dequantize().float().cuda()
    for m in (1, 33):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        assert _rel(packed.matmul(x), x.float() @ ref.T) < 2e-2
