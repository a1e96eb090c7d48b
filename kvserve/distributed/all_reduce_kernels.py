"""Triton kernels of the custom all-reduce: one-shot, two-shot, and one-shot fused with the
residual add and RMSNorm. Plain peer-to-peer loads and stores over NVLink, no multicast.

Every rank holds one symmetric data buffer (same size on all ranks; each rank has the device
addresses of all of them, ``data_ptrs`` int64 ``[W]``) laid out as three regions of
``REGION`` elements: two input regions used alternately, and an output region the two-shot
kernel pushes reduced chunks into. A symmetric int32 flag buffer ``[MAX_BLOCKS, W]`` per rank
(addresses ``flag_ptrs``) carries the barriers: block ``b`` of rank ``r`` writes its flag into
slot ``[b, r]`` of every peer and waits until its own slots ``[b, p]`` reach that flag.

The flag of a launch comes from a per-block counter in device memory (``cnt``, int32
``[MAX_BLOCKS]``, local to each rank) that the kernel reads and advances itself: nothing is
passed from the host per call, so a launch captured in a CUDA graph gets a fresh flag on
every replay. Flags only grow, so a wait compares with ``>=`` (as a signed difference, which
survives the int32 wrap).

Every launch uses the same ``GRID`` blocks whatever the message size (blocks without data
still pass the barriers), so all block counters move in step and the flag's parity picks the
input region consistently. Block ``b`` of every rank copies, and later reads, the same
element ranges, so within a launch a per-block barrier orders exactly the writes and reads
that touch each other. Across launches: when a rank starts launch K its launch K-1 has ended,
so every block of it passed a barrier its peers signalled from launch K-1, so every peer has
finished launch K-2; the only reads still running are launch K-1's, of the other input region
(one-shot), or of the output region (two-shot, whose input reads ended before its second
barrier), which launch K writes only after a barrier the peer signals from launch K.
Each rank sums the ranks' values in rank order in float32 and rounds once, so all ranks get
bit-identical results.

A wait gives up after ``MAX_SPIN`` polls and sets ``err[0] = 1`` (the result is then wrong,
but the process does not hang); ``CustomAllReduce.check()`` reads it.

Designs learnt from: vLLM's and SGLang's custom all-reduce (CUDA IPC, per-block flags),
TensorRT-LLM's one-shot/two-shot ("MultiShot") all-reduce.
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _round(x, dt: tl.constexpr):
    """Round float32 ``x`` to ``dt`` precision, staying float32 (as ``kvserve.layers.fused._round``:
    the norm rounds where the unfused torch ops do; kept here because distributed sits below layers)."""
    if dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x

#: Rows of flag slots (the most blocks a launch may use).
MAX_BLOCKS = 64
#: Blocks of every launch.
GRID = 48
#: Polls of a flag before a wait gives up: tens of seconds on a GPU, longer than a peer's
#: first-call Triton compile, so only a dead peer trips it.
MAX_SPIN = 1 << 26


@triton.jit
def _barrier(flag_ptrs, err_ptr, b, flag, rank, W: tl.constexpr, MAX_SPIN_: tl.constexpr):
    """Block ``b``'s barrier with its peers: publish ``flag`` (release), wait for theirs (acquire)."""
    tl.debug_barrier()  # every thread's writes before the release
    for r in tl.static_range(W):
        if r != rank:
            peer = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + b * W + rank, flag, sem="release", scope="sys")
    own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(W):
        if r != rank:
            v = tl.atomic_add(own + b * W + r, 0, sem="acquire", scope="sys")
            spins = 0
            while ((v - flag) < 0) & (spins < MAX_SPIN_):
                v = tl.atomic_add(own + b * W + r, 0, sem="acquire", scope="sys")
                spins += 1
            if (v - flag) < 0:
                tl.store(err_ptr, 1)
    tl.debug_barrier()  # no thread reads peers' data before the wait is over


@triton.jit
def _one_shot_kernel(
    x_ptr, out_ptr, data_ptrs, flag_ptrs, cnt_ptr, err_ptr, n, rank,
    REGION: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, MAX_SPIN_: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.num_programs(0)
    flag = tl.load(cnt_ptr + b) + 1
    region = (flag & 1) * REGION
    own = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(DT)), 16)
    ar = tl.arange(0, BLOCK)
    nslices = tl.cdiv(n, BLOCK)
    for s in range(b, nslices, g):
        offs = s * BLOCK + ar
        m = offs < n
        tl.store(own + region + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    _barrier(flag_ptrs, err_ptr, b, flag, rank, W, MAX_SPIN_)
    for s in range(b, nslices, g):
        offs = s * BLOCK + ar
        m = offs < n
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(W):
            p = tl.multiple_of(tl.load(data_ptrs + r).to(tl.pointer_type(DT)), 16)
            acc += tl.load(p + region + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
        tl.store(out_ptr + offs, _round(acc, DT).to(DT), mask=m)
    tl.store(cnt_ptr + b, flag)


@triton.jit
def _two_shot_kernel(
    x_ptr, out_ptr, data_ptrs, flag_ptrs, cnt_ptr, err_ptr, n, chunk, rank,
    REGION: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, MAX_SPIN_: tl.constexpr,
):
    # Reduce-scatter (rank r sums chunk r and pushes it to every rank's output region), then
    # all-gather from the local output region.
    b = tl.program_id(0)
    g = tl.num_programs(0)
    flag = tl.load(cnt_ptr + b) + 1
    region = (flag & 1) * REGION
    out_region = 2 * REGION
    own = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(DT)), 16)
    ar = tl.arange(0, BLOCK)
    nslices = tl.cdiv(chunk, BLOCK)
    for s in range(b, nslices, g):
        inner = s * BLOCK + ar
        for c in tl.static_range(W):
            offs = c * chunk + inner
            m = (inner < chunk) & (offs < n)
            tl.store(own + region + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    _barrier(flag_ptrs, err_ptr, b, flag, rank, W, MAX_SPIN_)
    for s in range(b, nslices, g):
        inner = s * BLOCK + ar
        offs = rank * chunk + inner
        m = (inner < chunk) & (offs < n)
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(W):
            p = tl.multiple_of(tl.load(data_ptrs + r).to(tl.pointer_type(DT)), 16)
            acc += tl.load(p + region + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
        v = _round(acc, DT).to(DT)
        for r in tl.static_range(W):
            p = tl.multiple_of(tl.load(data_ptrs + r).to(tl.pointer_type(DT)), 16)
            tl.store(p + out_region + offs, v, mask=m)
    _barrier(flag_ptrs, err_ptr, b, flag + 1, rank, W, MAX_SPIN_)
    for s in range(b, nslices, g):
        inner = s * BLOCK + ar
        for c in tl.static_range(W):
            offs = c * chunk + inner
            m = (inner < chunk) & (offs < n)
            tl.store(out_ptr + offs, tl.load(own + out_region + offs, mask=m, volatile=True), mask=m)
    tl.store(cnt_ptr + b, flag + 1)


@triton.jit
def _one_shot_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, data_ptrs, flag_ptrs, cnt_ptr, err_ptr,
    rows, d, eps, rank,
    REGION: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, MAX_SPIN_: tl.constexpr,
):
    # One row of [rows, d] at a time: sum over the ranks, + residual, RMSNorm; rounded to DT
    # where the unfused path (all-reduce, then kvserve.layers.fused.rms_norm) rounds.
    b = tl.program_id(0)
    g = tl.num_programs(0)
    flag = tl.load(cnt_ptr + b) + 1
    region = (flag & 1) * REGION
    own = tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(DT)), 16)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < d
    for t in range(b, rows, g):
        offs = t * d + cols  # < max_bytes elements: int32 is enough
        tl.store(own + region + offs, tl.load(x_ptr + offs, mask=cm), mask=cm)
    _barrier(flag_ptrs, err_ptr, b, flag, rank, W, MAX_SPIN_)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    for t in range(b, rows, g):
        offs = t * d + cols  # < max_bytes elements: int32 is enough
        acc = tl.zeros([BLOCK_D], tl.float32)
        for r in tl.static_range(W):
            p = tl.multiple_of(tl.load(data_ptrs + r).to(tl.pointer_type(DT)), 16)
            acc += tl.load(p + region + offs, mask=cm, other=0.0, volatile=True).to(tl.float32)
        res = tl.load(res_ptr + offs, mask=cm, other=0.0).to(tl.float32)
        x = _round(_round(acc, DT) + res, DT)
        tl.store(res_out_ptr + offs, x.to(DT), mask=cm)
        var = tl.sum(x * x, axis=0) / d
        y = _round(x * tl.rsqrt(var + eps), DT)
        tl.store(out_ptr + offs, _round(w * y, DT).to(DT), mask=cm)
    tl.store(cnt_ptr + b, flag)
