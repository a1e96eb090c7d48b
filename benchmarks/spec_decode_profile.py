"""CPU, batch 1: one `edit` request (benchmarks/spec_decode_cpu.py's first prompt) with n-gram
speculation k (0 = none), under cProfile: wall time, steps, and where the time goes.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/spec_decode_profile.py 4
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from spec_decode_cpu import edit_prompts  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 4}
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, disable_log_stats=True, speculative_config=spec)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": edit_prompts()[0]}], add_generation_prompt=True,
                                   tokenize=False)
    llm.generate([text], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    prof.disable()
    st = llm.llm_engine.stats
    print(f"k={k}: {dt:.2f} s for {len(out.outputs[0].token_ids)} tokens; verification steps {st.num_drafts}, "
          f"accepted {st.num_accepted_tokens}/{st.num_draft_tokens}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
