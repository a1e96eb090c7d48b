"""``cache_salt`` keeps tenants apart in every tier: the device prefix cache, the CPU tier, the
disk tier (across a restart) and the P/D transfer. Each test also checks that the same salt
does hit, so a "no hit" cannot come from a tier that is simply off."""

from __future__ import annotations

import json
import random

from kvserve import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [random.Random(5).randrange(3, 256) for _ in range(100)]  # 6 full blocks of 16 (+4)
FULL = 96


def _tiered(path, disk):
    return LLM(model=path, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=24, max_model_len=256,
               dtype="float32", max_num_seqs=4, disable_log_stats=True, kv_offloading_size=0.01, kv_disk_path=disk)


def _drop_device_cache(llm):
    for g in llm.llm_engine.engine_core.kv_cache_manager.groups:
        assert g.pool.reset_prefix_cache()


def _run(llm, salt):
    out = llm.generate([PROMPT], SP, use_tqdm=False, cache_salt=salt)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_no_cross_salt_hit_in_device_cpu_and_disk_tiers(tiny_llama_dir, tmp_path):
    llm = _tiered(tiny_llama_dir, str(tmp_path))
    tier = llm.llm_engine.engine_core.kv_connector
    ref, cached = _run(llm, "tenant-a")
    assert cached == 0
    for salt in ("tenant-b", "tenant-", None):  # the device cache holds tenant-a's blocks: no hit
        assert _run(llm, salt) == (ref, 0), salt
    _drop_device_cache(llm)  # now only the CPU tier holds them (each salt's own blocks)
    hits = tier.get_stats()["hit_tokens"]
    assert _run(llm, "tenant-c") == (ref, 0)
    assert tier.get_stats()["hit_tokens"] == hits
    _drop_device_cache(llm)
    assert _run(llm, "tenant-a") == (ref, FULL)  # the same salt hits the CPU tier
    assert tier.get_stats()["hit_tokens"] == hits + FULL
    llm.shutdown()  # writes the block files

    llm = _tiered(tiny_llama_dir, str(tmp_path))  # a restart: only the disk tier holds them
    tier = llm.llm_engine.engine_core.kv_connector
    assert _run(llm, "tenant-d") == (ref, 0)
    assert tier.get_stats()["disk_hit_tokens"] == 0
    _drop_device_cache(llm)
    assert _run(llm, "tenant-a") == (ref, FULL)
    assert tier.get_stats()["disk_hit_tokens"] == FULL
    llm.shutdown()


def test_pd_transfer_keeps_salts_apart(tiny_llama_dir):
    def mk(role):
        ktc = {"kv_connector": "P2PKVConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": 0}}
        return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=40,
                   max_model_len=256, dtype="float32", max_num_seqs=4, disable_log_stats=True,
                   kv_transfer_config=json.dumps(ktc))

    producer, consumer = mk("kv_producer"), mk("kv_consumer")
    try:
        got = {}
        for salt in ("tenant-b", "tenant-a"):  # params made under tenant-a, used by either
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            params = producer.generate([PROMPT], sp, use_tqdm=False, cache_salt="tenant-a")[0].kv_transfer_params
            assert params["cache_salt_digest"] and "tenant-a" not in json.dumps(params)
            sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                extra_args={"kv_transfer_params": params})
            out = consumer.generate([PROMPT], sp, use_tqdm=False, cache_salt=salt)[0]
            got[salt] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
            consumer.llm_engine.engine_core.kv_cache_manager.groups[0].pool.reset_prefix_cache()
        assert got["tenant-b"][1] == 0  # another salt: computed, nothing pulled
        assert got["tenant-a"][1] == len(PROMPT) - 1  # the same salt: pulled
        assert got["tenant-a"][0] == got["tenant-b"][0]
        stats = consumer.llm_engine.engine_core.scheduler.get_stats().kv_connector_stats
        assert stats["kv_transfers"] == 1 and stats["remote_prefill_requests"] == 1
    finally:
        producer.shutdown()
        consumer.shutdown()
