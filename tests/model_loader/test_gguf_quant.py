"""GGUF kept quantized: exact Q4 repacking, Q8_0 requantization, the real model's greedy tokens, start-up errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.layers.quantization.kernels import Int4Weight, PackedInt4, quantize_int8
from kvserve.model_loader.gguf_dequant import decode_q4, decode_q8_0
from kvserve.model_loader.gguf_quant import q8_0_to_int8


def _requantize_with_groups(w: torch.Tensor, ref: Int4Weight) -> torch.Tensor:
    """Quantize dense ``w`` with the group scales/mins of ``ref`` (dequantize-then-quantize)."""
    g = ref.group_size
    s, m = ref.scale.repeat_interleave(g, 1), ref.min.repeat_interleave(g, 1)
    return ((w - m) / s).round().clamp(0, 15).to(torch.uint8)


def test_real_q4_1_repack_equals_dequantize_then_quantize(smollm2_path):
    from gguf.quants import dequantize

    from kvserve.model_loader.gguf_loader import open_gguf

    reader = open_gguf(smollm2_path)
    tensors = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"][:4]
    assert tensors, "the default model ships Q4_1 tensors"
    for t in tensors:
        w4 = decode_q4(t.data, "Q4_1")
        dense = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(w4.dequantize(), dense)  # our decoding is llama.cpp's
        q2 = _requantize_with_groups(dense, w4)
        assert torch.equal(q2, w4.q)  # bit for bit in the 4-bit values
        a = PackedInt4(w4, torch.device("cpu"), torch.bfloat16)
        b = PackedInt4(Int4Weight(q2, w4.scale, w4.min, 32), torch.device("cpu"), torch.bfloat16)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_synthetic_q4_repack(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 96)).astype(np.float32)
    t = GGMLQuantizationType[kind]
    raw = quantize(a, t)
    w4 = decode_q4(raw, kind)
    dense = torch.from_numpy(dequantize(raw, t).copy())
    torch.testing.assert_close(w4.dequantize(), dense, rtol=0, atol=1e-6)
    assert torch.equal(_requantize_with_groups(dense, w4), w4.q)
    x = torch.randn(3, 96)
    from kvserve.layers.quantization.linear import QuantizedLinear

    y = QuantizedLinear.from_int4(w4, None, torch.device("cpu"), torch.float32)(x)
    torch.testing.assert_close(y, x @ dense.T, rtol=1e-4, atol=1e-4)


def test_q8_0_to_int8_is_dequantize_then_quantize():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    a = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = quantize(a, GGMLQuantizationType.Q8_0)
    q, d = decode_q8_0(raw)
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(q.float() * d.repeat_interleave(32, 1), dense)
    q8, s8 = q8_0_to_int8(q, d)
    r8, rs = quantize_int8(dense)
    assert torch.equal(q8, r8) and torch.equal(s8, rs)


def test_real_model_kept_quantized_greedy_equals_dequantized(llm):
    """Q4_1 kept quantized vs the session's dequantized float32 engine, both float32 activations (the
    Q4_1 scales are exact in float32; bf16 runs differ by rounding and part at near-ties)."""
    from kvserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,"]
    sp = SamplingParams(max_tokens=28, temperature=0)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    q = LLM(quantization="gguf", dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
            disable_log_stats=True)
    out = [o.outputs[0].token_ids for o in q.generate(prompts, sp, use_tqdm=False)]
    common = []
    for a, b in zip(ref, out):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        common.append(n)
    assert sum(common) / len(common) >= 24, common


@pytest.mark.parametrize("kw,match", [
    (dict(load_format="dummy", quantization="gguf"), "keeps a GGUF"),
    (dict(quantization="fp8", device="cpu"), "fp8 needs a CUDA GPU"),
    (dict(quantization="int5"), "quantization must be one of"),
])
def test_start_up_errors(kw, match):
    from kvserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw).create_engine_config()


def test_cli_rejects_unknown_quantization():
    import argparse

    from kvserve.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    assert parser.parse_args(["--quantization", "int4"]).quantization == "int4"
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--quantization", "bitsandbytes"])


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(16, 96), (3, 4, 64), (256,)])
def test_dequantize_tensor_bit_identical_to_gguf(kind, shape):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvserve.model_loader.gguf_dequant import dequantize_tensor

    t = GGMLQuantizationType[kind]
    raw = quantize((np.random.default_rng(0).standard_normal(shape) * 3).astype(np.float32), t)
    ref = torch.from_numpy(np.array(dequantize(raw, t)))
    out = dequantize_tensor(raw, t)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_real_gguf_reader_and_dequantization_match_gguf(smollm2_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from kvserve.model_loader.gguf_loader import gguf_architecture, open_gguf
    from kvserve.model_loader.gguf_dequant import dequantize_tensor

    ours, ref = open_gguf(smollm2_path), GGUFReader(smollm2_path)
    assert gguf_architecture(ours) == "llama"
    assert "tokenizer.ggml.tokens" not in ours.fields  # arrays are stepped over
    for name, f in ours.fields.items():  # scalars and strings as the library parses them
        g = ref.fields[name]
        assert (f.offset, f.data, f.types) == (g.offset, g.data, g.types)
        assert all(np.array_equal(a, b) for a, b in zip(f.parts, g.parts))
    assert (ours.data_offset, ours.alignment, len(ours.tensors)) == (ref.data_offset, ref.alignment, len(ref.tensors))
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes, a.data.shape) == (
            b.name, b.tensor_type, b.data_offset, b.n_bytes, b.data.shape)
    for t in [t for t in ours.tensors if t.tensor_type.name != "Q8_0"][:24] + [
            t for t in ours.tensors if t.tensor_type.name == "Q8_0"]:
        w, r = dequantize_tensor(t.data, t.tensor_type), torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(w.view(torch.int32), r.view(torch.int32)), t.name
