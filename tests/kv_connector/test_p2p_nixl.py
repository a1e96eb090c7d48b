"""The NIXL transport of P2PKVConnector beyond the shared round trips (test_p2p.py): READs of
scattered block runs between two real NIXL agents, and engines of mixed transports (a NIXL
consumer pulls over TCP from a TCP-only producer; a NIXL producer serves a TCP consumer).
Skipped where NIXL does not import."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvserve import SamplingParams
from kvserve.kv_connector.p2p.nixl_transport import NixlAgent, _runs, nixl_import_error
from test_p2p import GREEDY, PROMPT, _core, _decode, _free_all, _llm, _poll, _prefill, _worker
from test_p2p import colocated  # noqa: F401 - the fixture

_err = nixl_import_error()
pytestmark = pytest.mark.skipif(bool(_err), reason=f"NIXL does not import ({_err}); "
                                "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1")


def test_runs_merge_consecutive_pairs():
    ls, rs, n = _runs([3, 4, 5, 9, 10, 2], [7, 8, 12, 13, 14, 1])
    assert ls.tolist() == [3, 5, 9, 2] and rs.tolist() == [7, 12, 13, 1] and n.tolist() == [2, 1, 2, 1]


@pytest.mark.parametrize("dtype,ucx_tls", [(torch.float32, None), (torch.bfloat16, None), (torch.uint8, None),
                                            (torch.float32, "tcp")], ids=["f32", "bf16", "u8", "f32-ucx-tcp"])
def test_agent_read_scattered_blocks_bit_exact(dtype, ucx_tls, monkeypatch):
    """Two agents (two caches of 2 layers ``[2, 12, 4, 2, 8]``): a READ of scattered, partly
    consecutive block pairs lands exactly those pages, K and V, and touches nothing else,
    with the producer progressing its agent meanwhile (as a lending worker does). With
    ``UCX_TLS=tcp`` UCX moves the pages over TCP, as between hosts without RDMA."""
    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    g = torch.Generator().manual_seed(1)
    shape = (2, 12, 4, 2, 8)
    src = {i: torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).view(dtype) if dtype == torch.uint8
           else torch.randn(shape, generator=g).to(dtype) for i in range(2)}
    dst = {i: torch.zeros(shape, dtype=dtype) for i in range(2)}
    prod, cons = NixlAgent(f"test-prod-{ucx_tls}", src), NixlAgent(f"test-cons-{ucx_tls}", dst)
    stop = threading.Event()

    def progress():
        while not stop.is_set():
            prod.progress()
            time.sleep(2e-4)

    th = threading.Thread(target=progress, daemon=True)
    th.start()
    try:
        loc, rem = [1, 2, 3, 7, 11], [5, 6, 0, 9, 10]
        desc, md = prod.descriptor()
        n = cons.read(desc, md, [(loc, rem)], [[0, 1]], threading.Event(), 10.0)
        assert n == 2 * 2 * len(loc) * src[0][0, 0].numel() * src[0].element_size()
        for i in range(2):
            assert torch.equal(dst[i][:, loc].view(torch.uint8), src[i][:, rem].view(torch.uint8))
            rest = [b for b in range(12) if b not in loc]
            assert not dst[i][:, rest].view(torch.uint8).any()
        assert cons.reads == 1
        # A second READ reuses the loaded remote agent.
        assert cons.read(desc, md, [([0], [4])], [[1]], threading.Event(), 10.0) > 0
        assert torch.equal(dst[1][:, 0], src[1][:, 4]) and not dst[0][:, 0].view(torch.uint8).any()
        # Regions that do not fit this layout are refused before any READ.
        bad = dict(desc, regions={k: [v[0], v[1], v[2] * 2, v[3]] for k, v in desc["regions"].items()})
        with pytest.raises(ValueError, match="regions do not match"):
            cons.read(bad, md, [([0], [4])], [[1]], threading.Event(), 10.0)
    finally:
        stop.set()
        th.join()
        cons.close()
        prod.close()


@pytest.mark.parametrize("prod_t,cons_t", [("tcp", "nixl"), ("nixl", "tcp")])
def test_mixed_transports_fall_back_to_tcp(tiny_llama_dir, colocated, prod_t, cons_t):
    producer = _llm(tiny_llama_dir, "kv_producer", transport=prod_t)
    consumer = _llm(tiny_llama_dir, "kv_consumer", transport=cons_t)
    try:
        _, params = _prefill(producer)
        out = _decode(consumer, params)
        ref = colocated.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        assert out.num_cached_tokens == len(PROMPT) - 1
        stats = _core(consumer).scheduler.get_stats().kv_connector_stats
        assert stats["kv_transfers"] == 1 and stats["load_failures"] == 0
        if cons_t == "nixl":
            assert _worker(consumer).nixl.reads == 0  # the TCP-only producer offered no NIXL
        assert _core(consumer).kv_transfer_info()["kv_transport"] == cons_t
        _poll(producer, lambda: _free_all(producer) and not _core(producer).has_kv_transfers())
    finally:
        producer.shutdown()
        consumer.shutdown()
