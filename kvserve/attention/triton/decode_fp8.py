"""The decode kernel's FP8-dot steps (``decode.py``, constexpr ``FP8_DOT``; the algorithm and its
error bound are in ``decode.py``'s docstring): one online-softmax step over ``BLOCK_N`` e4m3 keys
with Q K^T and P V as e4m3 tensor-core dots, the query rows as the MMA's rows (``_fp8_step``) or
the keys (``_fp8_step_keys_rows``, constexpr ``FP8_T``). ``FP8_PV`` False (``fp8_pv``): Q K^T only
on the e4m3 codes; V's codes are converted to float16 (exact) and P V is a float16 dot with V's
scales on P, as the conversion path does (no V transpose through registers, no rounding of P to
e4m3; a float16 operand may be MN-major in shared memory, an FP8 one may not)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.attention.triton.kv_load import load_code_bytes, load_code_bytes_t, load_v_tile
from kvserve.attention.triton.prefill import e4m3_operand


@triton.jit
def _fp8_step(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, row_off, n_mask, q_scale, ks, vs,
              HEAD_DIM: tl.constexpr, FP8_DOT: tl.constexpr, FP8_PV: tl.constexpr = True):
    """One online-softmax step of the FP8-dot path over the keys at ``row_off [BLOCK_N]`` (e4m3
    codes; ``n_mask``), the query rows ``q [G_PAD, D]`` (e4m3, ``q_scale [G_PAD]`` their factors) as
    the MMA's rows; ``ks`` / ``vs [BLOCK_N]`` the per-token scales. V's scales join the logits
    (``log2 s_j``), so ``p_j s_j`` over the running maximum is ``exp2(logit - max)`` in [0, 1]:
    times 448 it is the e4m3 P operand, no per-tile maximum of the scales needed; the running sum
    adds those ``/ s_j`` (masked keys: ``s_j`` 1). ``acc`` is in units of 448. ``FP8_DOT`` 2 (the
    interpreter): the same e4m3 values in float32, exact products. ``FP8_PV`` False: the logits
    without ``log2 s_j``, P V on V's float16 codes with ``p_j s_j`` as P, ``acc`` in plain units.
    Returns ``(acc, m, l)``."""
    offs_d = tl.arange(0, HEAD_DIM)
    vs1 = tl.where(n_mask, vs, 1.0)
    if FP8_DOT == 1:  # loaded as e4m3 (a bitcast of loaded bytes would take the tile through registers)
        k = tl.load(k_cache_ptr.to(tl.pointer_type(tl.float8e4nv)) + row_off[None, :] + offs_d[:, None],
                    mask=n_mask[None, :], other=0.0)
        qk = tl.dot(q, k)
    else:
        k = load_code_bytes_t(k_cache_ptr, row_off, n_mask, HEAD_DIM, True, True).to(tl.float8e4nv, bitcast=True)
        qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    qk = qk * q_scale[:, None] * ks[None, :]
    if FP8_PV:
        qk += tl.log2(vs1)[None, :]
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    if not FP8_PV:
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_v_tile(v_cache_ptr, row_off, n_mask, 1, HEAD_DIM, True, False,
                        tl.float16 if FP8_DOT == 1 else tl.float32, 1)
        acc = tl.dot((p * vs[None, :]).to(v.dtype), v, acc * alpha[:, None],
                     input_precision="ieee" if FP8_DOT == 2 else "tf32")
    else:
        l_i = l_i * alpha + tl.sum(p * (1.0 / vs1)[None, :], 1)
        p8 = e4m3_operand(p * 448.0, FP8_DOT == 2)
        # V as bytes, bitcast in registers: an FP8 MMA takes V transposed (K-major), which Triton writes
        # to shared memory from registers; loaded as bytes the tile still comes through the software
        # pipeline (cp.async), loaded as e4m3 it would not
        v8 = load_code_bytes(v_cache_ptr, row_off, n_mask, HEAD_DIM, True, True).to(tl.float8e4nv, bitcast=True)
        if FP8_DOT == 1:
            acc = tl.dot(p8, v8, acc * alpha[:, None])
        else:
            acc = tl.dot(p8, v8.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _fp8_step_keys_rows(q_t, acc_t, m_i, l_i, k_cache_ptr, v_cache_ptr, row_off, n_mask, q_scale, ks, vs,
                        HEAD_DIM: tl.constexpr, FP8_DOT: tl.constexpr, FP8_PV: tl.constexpr = True):
    """``_fp8_step`` with the keys as the MMA's rows (``FP8_T``): ``S^T = K q^T`` ``[BLOCK_N, G_PAD]``
    and ``O^T += V^T P^T`` into ``acc_t [D, G_PAD]``, so the softmax's element-wise work covers the
    GROUP query rows padded to 16, not to an MMA's 64 rows; its maxima and sums run along axis 0.
    ``q_t [D, G_PAD]`` e4m3; ``FP8_PV`` as in ``_fp8_step``. Returns ``(acc_t, m, l)``."""
    offs_d = tl.arange(0, HEAD_DIM)
    vs1 = tl.where(n_mask, vs, 1.0)
    if FP8_DOT == 1:
        k = tl.load(k_cache_ptr.to(tl.pointer_type(tl.float8e4nv)) + row_off[:, None] + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0)
        s = tl.dot(k, q_t)
    else:
        k = load_code_bytes(k_cache_ptr, row_off, n_mask, HEAD_DIM, True, True).to(tl.float8e4nv, bitcast=True)
        s = tl.dot(k.to(tl.float32), q_t, input_precision="ieee")
    s = s * ks[:, None] * q_scale[None, :]
    if FP8_PV:
        s += tl.log2(vs1)[:, None]
    s = tl.where(n_mask[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    if not FP8_PV:
        l_i = l_i * alpha + tl.sum(p, 0)
        v = load_v_tile(v_cache_ptr, row_off, n_mask, 1, HEAD_DIM, True, False,
                        tl.float16 if FP8_DOT == 1 else tl.float32, 1)
        acc_t = tl.dot(tl.trans(v), (p * vs[:, None]).to(v.dtype), acc_t * alpha[None, :],
                       input_precision="ieee" if FP8_DOT == 2 else "tf32")
    else:
        l_i = l_i * alpha + tl.sum(p * (1.0 / vs1)[:, None], 0)
        p8 = e4m3_operand(p * 448.0, FP8_DOT == 2)
        v8 = load_code_bytes(v_cache_ptr, row_off, n_mask, HEAD_DIM, True, True).to(tl.float8e4nv, bitcast=True)
        if FP8_DOT == 1:
            acc_t = tl.dot(tl.trans(v8), p8, acc_t * alpha[None, :])
        else:
            acc_t = tl.dot(tl.trans(v8.to(tl.float32)), p8, acc_t * alpha[None, :], input_precision="ieee")
    return acc_t, m_new, l_i
