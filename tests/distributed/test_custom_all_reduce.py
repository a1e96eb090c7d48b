"""The custom all-reduce: its host logic (algorithm cut-over, when it is unavailable), the
fused all-reduce + add + RMSNorm fallback on 2 gloo ranks, and the Triton kernels' math.

The kernels cannot run multi-rank in the Triton interpreter (a rank's barrier waits for its
peers), so the ranks run one after another in one process over buffers of the layout the
kernels use: peers' inputs are placed in their regions beforehand and the flags preset, so
every wait passes at once and each kernel's copying, addressing and summing is checked.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit module is imported

from kvserve.distributed import custom_all_reduce as car  # noqa: E402


# -- host logic ----------------------------------------------------------------------------

def test_choose_algorithm_cut_overs():
    mb = 1 << 20
    assert car.choose_algorithm(8 << 10, 2, mb, 512 << 10) == "one_shot"
    assert car.choose_algorithm(512 << 10, 2, mb, 512 << 10) == "one_shot"
    assert car.choose_algorithm((512 << 10) + 2, 2, mb, 512 << 10) == "two_shot"
    assert car.choose_algorithm(mb, 2, mb, 512 << 10) == "two_shot"
    assert car.choose_algorithm(mb + 2, 2, mb, 512 << 10) is None  # NCCL above the cut-over
    assert car.choose_algorithm(4 << 10, 3, mb, 512 << 10) is None  # odd world size
    assert car.choose_algorithm(0, 2, mb, 512 << 10) is None
    assert car.DEFAULT_ONE_SHOT_BYTES[2] > car.DEFAULT_ONE_SHOT_BYTES[4] > car.DEFAULT_ONE_SHOT_BYTES[8]


def test_unavailable_reasons():
    cuda = torch.device("cuda", 0)
    every = lambda i, j: True  # noqa: E731
    assert car.unavailable_reason(cuda, 2, peer_access=every) is None
    assert car.unavailable_reason(cuda, 8, peer_access=every) is None
    assert "cpu" in car.unavailable_reason(torch.device("cpu"), 2, peer_access=every)
    assert "world size 3" in car.unavailable_reason(cuda, 3, peer_access=every)
    assert "world size 16" in car.unavailable_reason(cuda, 16, peer_access=every)
    assert "turned off" in car.unavailable_reason(cuda, 2, enabled=False, peer_access=every)
    no_1_to_2 = lambda i, j: (i, j) != (1, 2)  # noqa: E731
    assert "GPU 1 to GPU 2" in car.unavailable_reason(cuda, 4, peer_access=no_1_to_2)


def test_env_switch(monkeypatch):
    monkeypatch.delenv("KVSERVE_ALL_REDUCE", raising=False)
    assert car.enabled_by_env()
    monkeypatch.setenv("KVSERVE_ALL_REDUCE", "nccl")
    assert not car.enabled_by_env()
    monkeypatch.setenv("KVSERVE_ALL_REDUCE", "bogus")
    with pytest.raises(ValueError, match="KVSERVE_ALL_REDUCE"):
        car.enabled_by_env()


def test_create_falls_back_off_cuda():
    assert car.create(None, torch.device("cpu"), 2) is None


def test_disable_custom_all_reduce_flag():
    from kvserve.config import ParallelConfig
    from kvserve.engine.arg_utils import EngineArgs

    assert EngineArgs().disable_custom_all_reduce is False
    assert ParallelConfig().disable_custom_all_reduce is False
    assert ParallelConfig(2, disable_custom_all_reduce=True).disable_custom_all_reduce is True


# -- 2 gloo ranks: the fused op's fallback -------------------------------------------------

def _rank_main(rank: int, port: int, q) -> None:
    from kvserve.distributed import (destroy_distributed, get_custom_all_reduce, init_distributed,
                                     tp_all_reduce_add_rms_norm)
    from kvserve.layers.norm import RMSNorm

    torch.set_num_threads(1)  # a forked child: no intra-op pool
    try:
        init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
        g = torch.Generator().manual_seed(0)
        parts = [torch.randn(3, 32, generator=g) for _ in range(2)]
        residual = torch.randn(3, 32, generator=g)
        norm = RMSNorm(32, 1e-5)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.1, generator=g)
            got, got_res = tp_all_reduce_add_rms_norm(parts[rank].clone(), residual.clone(), norm)
            want, want_res = norm(parts[0] + parts[1], residual)
        q.put((rank, get_custom_all_reduce() is None, torch.allclose(got, want, atol=1e-6),
               torch.allclose(got_res, want_res, atol=1e-6)))
        destroy_distributed()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_fused_all_reduce_add_rms_norm_falls_back_on_gloo():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # no re-import of torch and kvserve per rank
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [(0, True, True, True), (1, True, True, True)]


# -- the kernels' math, ranks simulated one after another -----------------------------------

def _interpreted() -> bool:
    from kvserve.distributed import all_reduce_kernels as K

    return torch.cuda.is_available() or type(K._one_shot_kernel).__name__ == "InterpretedFunction"


class _SimRanks:
    """W ranks' buffers in this process, as ``CustomAllReduce`` lays them out."""

    def __init__(self, world: int, max_bytes: int) -> None:
        from kvserve.distributed import all_reduce_kernels as K

        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        self.K, self.world = K, world
        region = (max_bytes + 15) // 16 * 16
        self.data = [torch.zeros(3 * region, dtype=torch.uint8, device=device) for _ in range(world)]
        self.flags = [torch.full((K.MAX_BLOCKS * world,), 1 << 20, dtype=torch.int32, device=device)
                      for _ in range(world)]
        self.ranks = []
        for r in range(world):
            c = car.CustomAllReduce.__new__(car.CustomAllReduce)
            c.rank, c.world_size, c.device, c.group = r, world, device, None
            c.max_bytes, c.one_shot_bytes, c._k, c._region_bytes = max_bytes, max_bytes // 2, K, region
            c.data_ptrs = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64, device=device)
            c.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64,
                                       device=device)
            c.counters = torch.zeros(K.MAX_BLOCKS, dtype=torch.int32, device=device)
            c.grid = 4  # fewer interpreted programs; a fixed grid as on the GPU
            c.err = torch.zeros(1, dtype=torch.int32, device=device)
            self.ranks.append(c)

    def place_inputs(self, xs: list[torch.Tensor]) -> None:
        """Each rank's input in the region its next launch reads (the next flag's parity), and
        the flags armed so that every wait of that launch passes."""
        for f in self.flags:
            f.fill_(1 << 20)
        for c, d, x in zip(self.ranks, self.data, xs):
            flags = c.counters[:c.grid] + 1
            assert (flags == flags[0]).all()  # the blocks' flags move in step
            start = int(flags[0] & 1) * (c._region_bytes // x.element_size())
            d.view(x.dtype)[start:start + x.numel()].copy_(x.reshape(-1))

    def check(self) -> None:
        for c in self.ranks:
            c.check()


@pytest.fixture(autouse=True)
def _short_spin(monkeypatch):
    """A wait the simulation did not arm fails the test (err flag) instead of spinning for ages."""
    from kvserve.distributed import all_reduce_kernels as K

    monkeypatch.setattr(K, "MAX_SPIN", 100)


def _inputs(world: int, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # one GPU runs the compiled kernels
    return [torch.randn(*shape, generator=g).to(dtype).to(dev) for _ in range(world)]


@pytest.mark.parametrize("world,n,dtype", [(2, 1000, torch.float32), (4, 3000, torch.bfloat16)])
def test_one_shot_kernel_sums_every_rank(world, n, dtype):
    if not _interpreted():
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET was set")
    sim = _SimRanks(world, 16 << 10)
    xs = _inputs(world, (n,), dtype)
    want = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
    sim.place_inputs(xs)
    outs = [c.all_reduce(x.clone(), "one_shot") for c, x in zip(sim.ranks, xs)]
    sim.check()
    for out in outs:  # exact but for the fp32 summation order of 4 ranks (bf16: one ulp at most)
        torch.testing.assert_close(out, want, atol=0 if world == 2 else 2e-2, rtol=0 if world == 2 else 1e-2)
    assert torch.equal(outs[0], outs[-1])  # every rank the same bits
    assert all(c.counters[:c.grid].tolist() == [1] * c.grid for c in sim.ranks)  # every block's flag advanced


@pytest.mark.parametrize("world,n,dtype", [(2, 1001, torch.float32), (4, 2050, torch.bfloat16)])
def test_two_shot_kernel_reduce_scatter_then_gather(world, n, dtype):
    if not _interpreted():
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET was set")
    sim = _SimRanks(world, 16 << 10)
    xs = _inputs(world, (n,), dtype)
    want = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
    # First pass: every rank pushes its reduced chunk to all ranks' output regions (a rank
    # gathering before the later ranks pushed reads stale chunks). Second pass: all chunks there.
    for _ in range(2):
        for c in sim.ranks:
            c.counters.zero_()
        sim.place_inputs(xs)
        outs = [c.all_reduce(x.clone(), "two_shot") for c, x in zip(sim.ranks, xs)]
    sim.check()
    for out in outs:
        torch.testing.assert_close(out, want, atol=0 if world == 2 else 2e-2, rtol=0 if world == 2 else 1e-2)
    assert torch.equal(outs[0], outs[-1])
    assert all(c.counters[:c.grid].tolist() == [2] * c.grid for c in sim.ranks)  # two barriers, two flags


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_one_shot_add_rms_norm_kernel(dtype, atol):
    if not _interpreted():
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET was set")
    from kvserve.layers.norm import RMSNorm

    world, rows, d = 2, 3, 48
    sim = _SimRanks(world, 16 << 10)
    xs = _inputs(world, (rows, d), dtype)
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(rows, d, generator=g).to(dtype).to(sim.device)
    norm = RMSNorm(d, 1e-5).to(dtype).to(sim.device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g).to(sim.device) * 0.1 + 1)
        total = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
        want, want_res = norm(total, residual)
    sim.place_inputs(xs)
    for c, x in zip(sim.ranks, xs):
        assert c.fusable(x, residual, norm.weight)
        out, res = c.all_reduce_add_rms_norm(x.clone(), residual, norm.weight.detach(), 1e-5)
        assert torch.equal(res, want_res)
        torch.testing.assert_close(out, want, atol=atol, rtol=0)
    sim.check()


def test_launches_alternate_input_regions():
    """One-shot, fused, one-shot: each launch reads the region its flag's parity names."""
    if not _interpreted():
        pytest.skip("Triton kernels were imported before TRITON_INTERPRET was set")
    from kvserve.layers.norm import RMSNorm

    sim = _SimRanks(2, 16 << 10)
    norm = RMSNorm(32, 1e-5).to(sim.device)
    residual = torch.randn(2, 32, generator=torch.Generator().manual_seed(5)).to(sim.device)
    for step, kind in enumerate(("one_shot", "fused", "one_shot")):
        xs = _inputs(2, (2, 32), torch.float32, seed=step)
        sim.place_inputs(xs)
        total = xs[0] + xs[1]
        for c, x in zip(sim.ranks, xs):
            if kind == "fused":
                out, res = c.all_reduce_add_rms_norm(x.clone(), residual, norm.weight.detach(), 1e-5)
                with torch.no_grad():
                    want, want_res = norm(total, residual)
                torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
                torch.testing.assert_close(res, want_res, atol=1e-6, rtol=0)
            else:
                torch.testing.assert_close(c.all_reduce(x.clone(), kind), total, atol=1e-6, rtol=0)
    assert all(c.counters[:c.grid].tolist() == [3] * c.grid for c in sim.ranks)
    sim.check()
