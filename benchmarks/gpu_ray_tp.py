"""Ray on the GPU machine (``nvidia-h200-x2``): tensor parallel 2 through a one-node Ray cluster
started in the call, against the ``mp`` executor, in one call.

1. Ray: imported as is, else unpacked from ``.whl_ray/`` (``ray_trim.tar.xz`` and dependency
   wheels, built by ``benchmarks/gpu/ray_bundle.sh``; or plain ``ray-*.whl``) into ``--site``;
2. TP=2 with ``distributed_executor_backend="mp"``: ``LLM(...)`` start-up time, then greedy
   outputs of ``--num-prompts`` prompts (``--max-tokens`` tokens each, ignore EOS);
3. ``ray start --head --num-gpus 2`` (timed), ``RAY_ADDRESS`` pointed at it; the same with
   ``distributed_executor_backend="ray"``; ``ray stop`` at the end;
4. equality: the token ids of every prompt, ray vs mp.

Model: the Llama-3.1-8B shape with dummy bf16 weights (the same seed: the same weights on both
executors). Writes ``<out>/ray_tp.json``; prints a table. Exit status 0: outputs equal; 1: they
differ or a run failed; 3: Ray is not available (mp measured alone).

Usage (repo root): python3 benchmarks/gpu_ray_tp.py --out DIR [--num-prompts 4] [--max-tokens 32] [--cpu-smoke]
``--cpu-smoke``: a tiny Llama on the CPU (gloo), TP=2, a Ray cluster without GPUs.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def ensure_ray(site: str, wheels: str) -> tuple[bool, str]:
    """Import ray, installing it from ``wheels`` into ``site`` first if needed; (ok, how)."""
    os.makedirs(site, exist_ok=True)
    if site not in sys.path:
        sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    try:
        import ray  # noqa: F401
        return True, "installed"
    except ImportError:
        pass
    how = []
    trim = os.path.join(wheels, "ray_trim.tar.xz")
    if os.path.exists(trim):
        with tarfile.open(trim) as t:
            t.extractall(site)
        how.append("ray_trim.tar.xz")
    whls = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if whls:
        rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--target", site, *whls])
        how.append(f"{len(whls)} wheels (pip rc {rc})")
    if not how:
        return False, f"no Ray: not installed and nothing in {wheels}/"
    importlib.invalidate_caches()
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return False, f"ray still not importable after {', '.join(how)}: {exc}"
    return True, ", ".join(how)


def ray_cli() -> list[str]:
    """The ``ray`` command, run by this Python (a console script's shebang names the machine that
    packed it)."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]


def run_backend(model: str, backend: str, prompts: list[list[int]], max_tokens: int, smoke: bool,
                eager: bool) -> dict:
    """Start an LLM with TP=2 on ``backend``; its start-up seconds and greedy token ids."""
    from kvserve import LLM, SamplingParams

    kw = dict(load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=2,
              distributed_executor_backend=backend, max_model_len=1024, seed=0, enforce_eager=eager)
    kw.update(dict(dtype="float32", kv_cache_memory="64MiB") if smoke else
              dict(dtype="bfloat16", kv_cache_memory="8GiB"))
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    startup = time.perf_counter() - t0
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.perf_counter() - t1
    finally:
        llm.shutdown()
    return {"backend": backend, "startup_s": round(startup, 2), "generate_s": round(gen_s, 3),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvserve-ray-tp"))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--site", default="/tmp/site", help="where Ray is unpacked when it is not installed")
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl_ray"))
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture CUDA graphs (default: eager, so both start-ups fit the part's 60 s)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny Llama on the CPU (plumbing check)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    eager = not a.cuda_graphs
    res: dict = {"bench": "ray_tp", "cpu_smoke": a.cpu_smoke, "tensor_parallel_size": 2, "enforce_eager": eager,
                 "num_prompts": a.num_prompts, "max_tokens": a.max_tokens}
    t0 = time.perf_counter()
    ok_ray, how = ensure_ray(a.site, a.wheels)
    res["ray_install"] = how
    res["ray_install_s"] = round(time.perf_counter() - t0, 2)
    print(f"ray: {how} ({res['ray_install_s']} s)", flush=True)

    import transformers

    if a.cpu_smoke:
        cfg = TINY
    else:
        sys.path.insert(0, HERE)
        from gpu_decode import LLAMA31_8B

        cfg = dict(LLAMA31_8B, architectures=["LlamaForCausalLM"])
    model = os.path.join(tempfile.mkdtemp(prefix="kvserve_ray_tp_"), "model")
    transformers.LlamaConfig(**cfg).save_pretrained(model)
    res["model"] = "tiny" if a.cpu_smoke else "llama31-8b shape, dummy bf16"
    vocab = cfg["vocab_size"]
    prompts = [[(7 + 31 * i + 13 * j) % (vocab - 3) + 3 for j in range(16 + 8 * i)] for i in range(a.num_prompts)]

    mp = run_backend(model, "mp", prompts, a.max_tokens, a.cpu_smoke, eager)
    res["mp"] = mp
    print(f"mp: start-up {mp['startup_s']} s, generate {mp['generate_s']} s", flush=True)
    status = 3
    if ok_ray:
        env = dict(os.environ)
        cmd = ray_cli() + ["start", "--head", "--num-gpus", "0" if a.cpu_smoke else "2",
                                 "--num-cpus", "4" if a.cpu_smoke else "8", "--include-dashboard=false",
                                 "--disable-usage-stats", "--port", "6389"]
        t1 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        res["ray_start_s"] = round(time.perf_counter() - t1, 2)
        res["ray_start_rc"] = p.returncode
        print(f"ray start: rc {p.returncode} in {res['ray_start_s']} s", flush=True)
        if p.returncode != 0:
            print(p.stdout[-2000:], p.stderr[-3000:])
            status = 1
        else:
            os.environ["RAY_ADDRESS"] = "127.0.0.1:6389"
            try:
                ray = run_backend(model, "ray", prompts, a.max_tokens, a.cpu_smoke, eager)
                res["ray"] = ray
                print(f"ray: start-up {ray['startup_s']} s, generate {ray['generate_s']} s", flush=True)
                same = [r == m for r, m in zip(ray["tokens"], mp["tokens"])]
                res["equal_per_prompt"] = same
                res["outputs_equal"] = all(same)
                status = 0 if all(same) else 1
            except Exception as exc:  # recorded: the JSON still says what ran
                res["ray_error"] = repr(exc)
                print(f"ray run failed: {exc!r}")
                status = 1
            finally:
                subprocess.run(ray_cli() + ["stop", "--force"], env=env, capture_output=True, timeout=60)
    with open(os.path.join(a.out, "ray_tp.json"), "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    ray_r = res.get("ray", {})
    print("| executor | start-up s | generate s | outputs equal mp |")
    print("|--|--|--|--|")
    print(f"| mp | {mp['startup_s']} | {mp['generate_s']} | - |")
    print(f"| ray | {ray_r.get('startup_s', '-')} (+ ray start {res.get('ray_start_s', '-')}) | "
          f"{ray_r.get('generate_s', '-')} | {res.get('outputs_equal', how if not ok_ray else '-')} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
