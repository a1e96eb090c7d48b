"""FP8 W8A8: the activation quantization, RMSNorm + quantization and block-scaled GEMM kernels
(``triton_fp8``, under the Triton interpreter on the CPU) against torch, and the W8A8 linear against
the float product within ``fp8_w8a8.W8A8_REL_BOUND``."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantization import QuantizedLinear, quantize_model
from kvserve.layers.quantization import fp8_w8a8 as f8
from kvserve.layers.quantization import triton_fp8 as tf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


def _check_fused(q, s, ref):
    """A fused kernel's FP8 output against quantizing the unfused float output ``ref``: equal codes up
    to summation-order ties (interpreter); on CUDA, where rsqrt / exp / division differ in the last bits
    and can move a scale, the dequantized values within e4m3's half-spacing (2^-4 relative, plus the
    model dtype's last bits) of ``ref``."""
    qr, sr = f8.quantize_act_ref(ref.cpu())
    if DEV == "cuda":
        deq, r = q.float().cpu() * s.cpu(), ref.float().cpu()
        assert ((deq - r).abs() <= (2 ** -4 + 2 ** -7) * r.abs() + 2 ** -9 * s.cpu()).all()  # + bf16 ulps
        return
    torch.testing.assert_close(s.cpu(), sr, rtol=1e-6, atol=0)
    assert (_codes(q) != _codes(qr)).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [None, 128])
def test_activation_quant_kernel_equals_torch(dtype, group):
    torch.manual_seed(0)
    x = (torch.randn(5, 300) * torch.logspace(-3, 2, 5)[:, None]).to(DEV, dtype)
    x[2, :7] = 0  # exact zeros stay zero; a partly-zero row keeps a positive scale
    x[3] = 0  # an all-zero row: scale clamped, codes 0
    q, s = tf.quant_fp8(x, group)
    qr, sr = f8.quantize_act_ref(x.cpu(), group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ((5, 1) if group is None else (5, 3))
    # CUDA's fp32 division is not correctly rounded (2 ulp): a code may differ at an exact rounding tie
    torch.testing.assert_close(s.cpu(), sr, rtol=1e-6 if DEV == "cuda" else 0, atol=0)
    mismatch = (_codes(q) != _codes(qr)).float().mean().item()
    assert mismatch <= (1e-3 if DEV == "cuda" else 0)  # e4m3 round-to-nearest-even, binade carries included


@pytest.mark.parametrize("residual", [False, True])
def test_fused_norm_quant_equals_unfused(residual):
    torch.manual_seed(1)
    d = 96
    norm = RMSNorm(d, 1e-5).to(DEV, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
    x = torch.randn(6, d, device=DEV, dtype=torch.bfloat16)
    r = torch.randn(6, d, device=DEV, dtype=torch.bfloat16) if residual else None
    q, s, res = tf.rms_norm_quant_fp8(x, norm.weight, norm.variance_epsilon, r)
    _check_fused(q, s, norm._norm(x if r is None else x + r))
    if residual:
        assert torch.equal(res, x + r)
    # the module: above fp8_out_min_m rows it returns the FP8 input, below it the normed tensor
    norm.fp8_out_min_m = 4
    act, _ = norm(x, torch.zeros_like(x))
    assert isinstance(act, f8.Fp8Act) and act.shape == x.shape
    assert isinstance(norm(x[:4]), torch.Tensor)


def test_fused_silu_mul_quant_equals_unfused():
    from kvserve.layers.activation import SiluAndMul

    torch.manual_seed(3)
    x = torch.randn(5, 2 * 80, device=DEV, dtype=torch.bfloat16) * 3
    q, s = tf.silu_mul_quant_fp8(x)
    _check_fused(q, s, SiluAndMul()(x.cpu()))
    act = f8.SiluAndMulFp8()
    act.fp8_out_min_m = 2
    assert isinstance(act(x), f8.Fp8Act) and isinstance(act(x[:2]), torch.Tensor)


@pytest.mark.parametrize("m,n,k", [(5, 70, 200), (20, 72, 384)])
def test_block_gemm_matches_emulation(m, n, k):
    torch.manual_seed(m + n)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    wq = (torch.randn(n, k) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEV)
    ws = torch.rand(n, -(-k // 128), device=DEV) * 1e-2
    xq, xs = tf.quant_fp8(x, 128)
    y = tf.block_gemm(xq, xs, wq, ws, torch.float32, config=(16, 32, 4, 1))
    ref = f8.matmul_emulated(xq, xs, wq, ws, torch.float32)
    # CUDA: FP8 tensor-core dots accumulate with ~14 mantissa bits within each 128-wide K step
    assert ((y - ref).norm() / ref.norm()).item() < (1e-3 if DEV == "cuda" else 1e-6)


def test_w8a8_within_documented_bound_and_fp8_input_path():
    torch.manual_seed(2)
    lin = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(20, 256)
    ql = QuantizedLinear.from_dense(lin, "fp8", torch.float32)
    wd = ql.packed.qt.t().float() * ql.packed.scale.reshape(-1, 1)
    ref = x @ wd.T + lin.bias.detach()  # dequantized weights, unquantized activations
    y = ql(x)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 0 < rel < f8.W8A8_REL_BOUND, rel
    xq, xs = f8.quantize_act_ref(x)
    assert torch.equal(ql(f8.Fp8Act(xq, xs, torch.float32)), y)  # the norm-quantized input: same numerics
    # block-scaled weights (128 x 128 grid) through the same linear
    wq, ws = f8.quantize_act_ref(lin.weight.detach(), 128)  # per row per 128 columns
    bl = QuantizedLinear.from_fp8_block(f8.Fp8BlockWeight(wq, ws), lin.bias.detach(), torch.device("cpu"),
                                        torch.float32)
    rel = ((bl(x) - (x @ lin.weight.detach().T + lin.bias.detach())).norm() / ref.norm()).item()
    assert rel < f8.W8A8_REL_BOUND


def test_norms_switched_only_before_fp8_linears():
    import transformers

    from kvserve.models.llama import LlamaForCausalLM

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(cfg, torch.float32)
    quantize_model(model, "int8", torch.float32)
    assert all(m.fp8_out_min_m is None for m in model.modules() if isinstance(m, RMSNorm))
    assert not any(isinstance(m, f8.SiluAndMulFp8) for m in model.modules())
    model = LlamaForCausalLM(cfg, torch.float32)
    quantize_model(model, "fp8", torch.float32)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert sum(m.fp8_out_min_m == 0 for m in norms) == 4  # 2 per layer; the final norm feeds the LM head
    assert model.model.norm.fp8_out_min_m is None
    assert all(isinstance(layer.mlp.act, f8.SiluAndMulFp8) and layer.mlp.act.fp8_out_min_m == 0
               for layer in model.model.layers)
