"""Group-quantized (GPTQ / AWQ, 4 or 8 bits) MoE expert weights, kept packed, and the fused W4A16 MoE kernel.

``GroupQuantExperts`` stacks every local expert's ``GroupQuantWeight`` (``w = (q - z) * s`` per group of
input features) in the layout of the dense W4A16 GEMM (``quantization.triton_w4a16.pack``), one slice per
expert: ``qweight`` int32 ``[E, Kp / PACK, N]``, ``scales`` ``[E, Kp / G, N]`` (float16 when exact, as GPTQ
and AWQ store them, else the activation dtype), ``zeros`` uint8 ``[E, Kp / G, N]`` (None: symmetric, ``z =
2^(bits-1)``), ``perm`` int32 ``[E, K]`` or None (GPTQ ``desc_act``: each expert's K sorted by group at load;
the kernel gathers the activations in that order). Word row ``16 b + r`` of an expert holds, in field ``j``,
``q[k = KB b + 16 j + r, n]`` with ``KB = 16 * PACK`` (128 rows for 4 bits), so one coalesced
``[16, BLOCK_N]`` int32 tile unpacks field by field into ``PACK`` contiguous 16-row K-slices.

``fused_experts_w4a16`` is ``triton_moe.fused_experts_triton`` with these weights: the same expert
sort / pad (``moe_align_block_size``), grouped GEMMs and deterministic combine, and in the K loop each
16-row slice of the expert's packed tile is unpacked, dequantized in registers (``(q - z) * s``, its
group's scale and zero loaded once per group) and fed to ``tl.dot`` (with ``perm``, the matching
activation columns gathered) (the weight is read once, packed:
the dequantize-in-registers idea of Marlin, Frantar et al., arXiv:2408.11743). On the CPU the torch
expert loop (``layer.fused_experts_torch``) reads ``GroupQuantExperts[e]``: that expert dequantized.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from kvserve.layers.quantization.group_quant import GroupQuantWeight

#: expert formats of ``FusedMoE.set_group_quant_experts`` (``--quantization``'s checkpoint methods)
GROUP_QUANT_METHODS = ("gptq", "awq")


class GroupQuantExperts:
    """Packed group-quantized weights of ``E`` local experts, each ``[N, K]`` (module doc for the layout).

    ``experts``: one ``GroupQuantWeight`` per local expert, all of the same shape, bits and group size (each
    may carry its own ``perm``). ``dtype``: the activation dtype. Raises ValueError otherwise.
    """

    def __init__(self, experts: Sequence[GroupQuantWeight], device: torch.device, dtype: torch.dtype,
                 name: str = "experts") -> None:
        from kvserve.layers.quantization import triton_w4a16 as tw

        if not experts:
            raise ValueError(f"{name}: no expert weights")
        w0 = experts[0]
        self.n, self.k = w0.q.shape
        self.bits, self.dtype = w0.bits, dtype
        if self.bits not in (4, 8):
            raise ValueError(f"{name}: {self.bits}-bit expert weights are not supported (4 or 8)")
        for i, w in enumerate(experts):
            if tuple(w.q.shape) != (self.n, self.k) or w.bits != self.bits or w.group_size != w0.group_size:
                raise ValueError(f"{name}: expert {i} is {w.bits}-bit {tuple(w.q.shape)} group {w.group_size}, "
                                 f"expected {self.bits}-bit {(self.n, self.k)} group {w0.group_size} like expert 0")
        kb = tw.block_rows(self.bits)
        kp = -(-self.k // kb) * kb
        g = kp if w0.group_size == self.k and self.k % kb else w0.group_size  # per channel: one group of Kp
        n_groups = -(-kp // g)
        pad = n_groups - w0.scale.shape[1]
        e = len(experts)
        self.group_size, self.kp = g, kp
        self.qweight = torch.empty(e, kp // (32 // self.bits), self.n, dtype=torch.int32, device=device)
        scales = torch.empty(e, n_groups, self.n, dtype=torch.float32, device=device)
        sym = all(w.zero is None for w in experts)
        zeros = None if sym else torch.empty(e, n_groups, self.n, dtype=torch.uint8, device=device)
        for i, w in enumerate(experts):
            self.qweight[i] = pack_k_major(w.q.to(device), self.bits)
            scales[i] = F.pad(w.scale.to(device, torch.float32), (0, pad)).t()
            if zeros is not None:
                zeros[i] = F.pad(w.zeros().to(device), (0, pad)).t().to(torch.uint8)
        exact16 = bool(torch.equal(scales.half().float(), scales))
        self.scales = scales.to(torch.float16 if exact16 else dtype)
        self.zeros = zeros
        self.perm = None  # int32 [E, K]: expert e's stored K order (desc_act), None when every expert is in order
        if any(w.perm is not None for w in experts):
            ident = torch.arange(self.k)
            self.perm = torch.stack([(w.perm if w.perm is not None else ident).cpu().to(torch.int32)
                                     for w in experts]).to(device)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)``, the dense stack's shape."""
        return (self.qweight.shape[0], self.n, self.k)

    def dequantize(self, e: int) -> torch.Tensor:
        """Expert ``e`` as float32 ``[N, K]`` in the model's input order: ``(q - z) * s`` (``perm`` undone)."""
        q = unpack_k_major(self.qweight[e], self.bits, self.kp).float()  # [N, Kp]
        s = self.scales[e].float().t().repeat_interleave(self.group_size, 1)
        z = (self.zeros[e].float().t().repeat_interleave(self.group_size, 1) if self.zeros is not None
             else float(1 << (self.bits - 1)))
        w = ((q - z) * s)[:, :self.k]
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm[e].long()] = w
        return out

    def __getitem__(self, e: int) -> torch.Tensor:
        """Expert ``e`` dequantized in the activation dtype (the torch expert loop's ``w[e]``)."""
        return self.dequantize(e).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return ([self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
                + ([self.perm] if self.perm is not None else []))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def pack_k_major(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` uint8 ``[N, K]`` (values < 2^bits) -> int32 ``[Kp / (32 / bits), N]``, the experts' layout: blocks
    of ``KB = 16 * (32 / bits)`` input rows; word row ``16 * b + r`` holds in its field ``j`` (bits
    ``bits * j ...``) ``q[k = KB * b + 16 * j + r, n]``, so a ``[16, BLOCK_N]`` tile unpacks field by field
    into contiguous 16-row K slices (one ``tl.dot`` K-step each). K is zero-padded to a multiple of KB."""
    n, k = q.shape
    per, kb = 32 // bits, 16 * (32 // bits)
    kp = -(-k // kb) * kb
    qp = F.pad(q.to(torch.int64), (0, kp - k))
    v = qp.reshape(n, kp // kb, per, 16).permute(1, 3, 0, 2)  # [N, blocks, field j, row r] -> [blocks, r, N, j]
    words = (v << (torch.arange(per, dtype=torch.int64, device=q.device) * bits)).sum(-1)  # disjoint fields
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.reshape(kp // per, n).to(torch.int32).contiguous()


def unpack_k_major(w: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of ``pack_k_major``: int32 ``[Kp / (32 / bits), N]`` -> uint8 ``[N, k]``."""
    per, kb = 32 // bits, 16 * (32 // bits)
    n, kp = w.shape[1], w.shape[0] * per
    shifts = torch.arange(per, dtype=torch.int32, device=w.device) * bits
    v = (w.reshape(kp // kb, 16, n)[..., None] >> shifts) & ((1 << bits) - 1)  # [blocks, r, N, j]
    return v.permute(2, 0, 3, 1).reshape(n, kp)[:, :k].to(torch.uint8)


# ----------------------------------------------------------------------------- Triton kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the torch loop
    triton = None

if triton is not None:

    @triton.jit
    def _plane(raw, j: tl.constexpr, sc, zs, BITS: tl.constexpr, dt: tl.constexpr):
        """Field ``j`` of a ``[16, BLOCK_N]`` int32 tile -> its weights ``q * s - z * s`` in ``dt``."""
        q = ((raw >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)
        return (q * sc[None, :] - zs[None, :]).to(dt)

    @triton.jit
    def _moe_w4a16_kernel(a_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, topk_w_ptr, sorted_ptr,
                          expert_ids_ptr, post_pad_ptr, N, K, NW, numel, a_row_div, num_blocks_m, n_kblocks,
                          stride_am, stride_we, stride_se, stride_be, stride_om, alpha, limit,
                          GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                          MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BITS: tl.constexpr,
                          GROUP: tl.constexpr, ZP_INT: tl.constexpr, HAS_PERM: tl.constexpr, PPG: tl.constexpr,
                          GPB: tl.constexpr,
                          WIDEN: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """``out[r, n] = act(a[r // a_row_div] @ W[e]^T ...)`` for the sorted rows ``r`` of one block, ``W[e]``
        dequantized from its packed tiles (``NW`` stored columns: ``2N`` gate then up when GATED)."""
        PACK: tl.constexpr = 32 // BITS
        KB: tl.constexpr = 16 * PACK
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
            return
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)
        row_ok = rows < numel
        a_rows = (rows // a_row_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_r = tl.arange(0, 16)
        cdt = tl.float32 if WIDEN else a_ptr.dtype.element_ty
        a_base = a_ptr + a_rows[:, None] * stride_am + offs_r[None, :]
        w_tile = w_ptr + e * stride_we + offs_r[:, None] * NW + offs_n[None, :]
        s_base = s_ptr + e * stride_se + offs_n
        z_base = z_ptr + e * stride_se + offs_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for b in range(0, n_kblocks):
            raw = tl.load(w_tile + b * 16 * NW, mask=n_ok[None, :], other=0)
            if GATED:
                raw_up = tl.load(w_tile + b * 16 * NW + N, mask=n_ok[None, :], other=0)
            for gi in tl.static_range(GPB):
                grp = (b * KB + gi * PPG * 16) // GROUP
                sc = tl.load(s_base + grp * NW, mask=n_ok, other=0).to(tl.float32)
                if ZP_INT:
                    zs = tl.load(z_base + grp * NW, mask=n_ok, other=0).to(tl.float32) * sc
                else:
                    zs = sc * (1 << (BITS - 1))
                if GATED:
                    sc_up = tl.load(s_base + grp * NW + N, mask=n_ok, other=0).to(tl.float32)
                    if ZP_INT:
                        zs_up = tl.load(z_base + grp * NW + N, mask=n_ok, other=0).to(tl.float32) * sc_up
                    else:
                        zs_up = sc_up * (1 << (BITS - 1))
                for j in tl.static_range(gi * PPG, gi * PPG + PPG):
                    k0 = b * KB + j * 16
                    if HAS_PERM:  # desc_act: this expert's K order, a gather of the activations
                        k_ok = k0 + offs_r < K
                        kk = tl.load(perm_ptr + e * K + k0 + offs_r, mask=k_ok, other=0)
                        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                                    mask=row_ok[:, None] & k_ok[None, :], other=0)
                    elif EVEN_K:
                        a = tl.load(a_base + k0, mask=row_ok[:, None], other=0)
                    else:
                        a = tl.load(a_base + k0, mask=row_ok[:, None] & (k0 + offs_r < K)[None, :], other=0)
                    a = a.to(cdt)
                    acc += tl.dot(a, _plane(raw, j, sc, zs, BITS, cdt), input_precision=PRECISION)
                    if GATED:
                        acc_up += tl.dot(a, _plane(raw_up, j, sc_up, zs_up, BITS, cdt), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_ok, other=0).to(tl.float32)[None, :]
        if GATED:
            if ACT == 0:  # silu(gate) * up
                acc = acc * tl.sigmoid(acc) * acc_up
            else:  # gpt-oss's clamped SwiGLU
                if HAS_LIMIT:
                    acc = tl.minimum(acc, limit)
                    acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
                acc = (acc_up + 1.0) * (acc * tl.sigmoid(acc * alpha))
        if MUL_WEIGHT:
            acc *= tl.load(topk_w_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


#: ``(max tokens, BLOCK_M, (w13 BLOCK_N, warps, stages), (w2 BLOCK_N, warps, stages), GROUP_M)``; BLOCK_K is
#: the packed block (128 rows at 4 bits). Decode is weight-read bound: BLOCK_M 16 and narrow N tiles.
W4A16_MOE_CONFIGS = (
    (32, 16, (32, 4, 3), (64, 4, 3), 1),
    (128, 16, (64, 4, 3), (64, 4, 3), 1),
    (512, 32, (64, 4, 3), (128, 4, 3), 8),
    (2048, 64, (64, 4, 3), (128, 8, 3), 8),
    (1 << 62, 64, (128, 8, 3), (128, 8, 3), 8),
)


def w4a16_moe_config(num_tokens: int) -> tuple:
    """The table row (``W4A16_MOE_CONFIGS``) for ``num_tokens`` tokens."""
    for row in W4A16_MOE_CONFIGS:
        if num_tokens <= row[0]:
            return row
    return W4A16_MOE_CONFIGS[-1]


def _launch(a, w: GroupQuantExperts, bias, out, topk_w, sorted_ids, expert_ids, post_pad, n, numel, a_row_div,
            num_blocks, bm, cfg, group_m, gated, act, alpha, limit, mul_weight):
    from kvserve.layers.quantization import triton_w4a16 as tw

    bn, warps, stages = cfg
    bn = max(16, min(bn, triton.next_power_of_2(n)))
    pack = 32 // w.bits
    ppg = min(pack, w.group_size // 16)
    widen = a.device.type != "cuda" and a.dtype != torch.float32  # interpreter: no bf16/fp16 numpy dot
    k = a.shape[1]
    dummy = w.scales
    _moe_w4a16_kernel[(num_blocks * triton.cdiv(n, bn),)](
        a, w.qweight, w.scales, w.zeros if w.zeros is not None else dummy, w.perm if w.perm is not None else dummy,
        bias if bias is not None else dummy,
        out, topk_w, sorted_ids, expert_ids, post_pad, n, k, w.n, numel, a_row_div, num_blocks,
        triton.cdiv(k, tw.block_rows(w.bits)), a.stride(0), w.qweight.stride(0), w.scales.stride(0),
        bias.stride(0) if bias is not None else 0, out.stride(0), float(alpha),
        float(limit if limit is not None else 0.0), GATED=gated, ACT=act, HAS_LIMIT=limit is not None and gated,
        MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None, BITS=w.bits, GROUP=w.group_size,
        ZP_INT=w.zeros is not None, HAS_PERM=w.perm is not None, PPG=ppg, GPB=pack // ppg, WIDEN=widen,
        EVEN_K=k % tw.block_rows(w.bits) == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def fused_experts_w4a16(hidden: torch.Tensor, w13: GroupQuantExperts, w2: GroupQuantExperts,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "silu",
                        w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                        expert_start: int = 0, swiglu_alpha: float = 1.702, swiglu_limit: Optional[float] = 7.0,
                        config: Optional[tuple] = None) -> torch.Tensor:
    """The fused MoE over group-quantized experts (``triton_moe.fused_experts_triton``'s contract).

    hidden ``[T, H]`` (bf16/fp16, or fp32; CUDA or the Triton interpreter); ``w13`` ``(E_local, 2I, H)`` and
    ``w2`` ``(E_local, H, I)`` as ``GroupQuantExperts``; biases ``[E_local, 2I]`` / ``[E_local, H]``; topk
    ``[T, k]`` (weights float32, global ids). ``config`` overrides the ``W4A16_MOE_CONFIGS`` row.
    Returns ``[T, H]`` in hidden's dtype. Raises ValueError for an unknown activation or mismatched shapes.
    """
    from kvserve.layers.moe.triton_moe import ACT_SILU, ACT_SWIGLUOAI, _combine_kernel, moe_align_block_size

    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"unsupported MoE activation {activation!r}")
    t, h = hidden.shape
    e_local, two_i, h13 = w13.shape
    i = two_i // 2
    if h13 != h or tuple(w2.shape) != (e_local, h, i):
        raise ValueError(f"fused_experts_w4a16: w13 {w13.shape} and w2 {w2.shape} do not fit hidden "
                         f"{tuple(hidden.shape)}")
    k = topk_ids.shape[1]
    numel = t * k
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    _, bm, c13, c2, group_m = config or w4a16_moe_config(t)
    sorted_ids, expert_ids, post_pad = moe_align_block_size(topk_ids, bm, e_local, expert_start)
    num_blocks = expert_ids.numel()
    weights = topk_weights.reshape(-1).contiguous()
    act = ACT_SILU if activation == "silu" else ACT_SWIGLUOAI
    inter = torch.empty(numel, i, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, w13_bias, inter, weights, sorted_ids, expert_ids, post_pad, i, numel, k, num_blocks, bm,
            c13, group_m, True, act, swiglu_alpha, swiglu_limit, False)
    buf = torch.empty(numel, h, dtype=hidden.dtype, device=hidden.device)
    _launch(inter, w2, w2_bias, buf, weights, sorted_ids, expert_ids, post_pad, h, numel, 1, num_blocks, bm,
            c2, group_m, False, act, 0.0, None, True)
    out = torch.empty_like(hidden)
    block_t, block_h = min(8, triton.next_power_of_2(t)), min(512, triton.next_power_of_2(h))
    _combine_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        buf, topk_ids.contiguous(), out, t, h, expert_start, e_local, TOPK=k, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4)
    return out
