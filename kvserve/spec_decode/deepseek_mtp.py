"""DeepSeek multi-token prediction as a speculative proposer (``"method": "deepseek_mtp"``).

DeepSeek-V3 / R1 checkpoints carry an MTP layer (arXiv:2412.19437, section 2.2;
``kvserve.models.deepseek_mtp``) trained to predict the token after next from the main
model's hidden state and the next token's embedding: a one-layer draft head that ships with
the model. It drafts like an EAGLE-1 head, so this proposer is ``EagleProposer`` with that
head: pair ``p`` of a request is ``(h_p, t_{p+1})``, the layer keeps one latent KV row per
pair in its own paged pool (an ``MLAAttentionSpec`` cache: ``kv_lora_rank + qk_rope_head_dim``
values per token), and ``k > 1`` drafts reuse the one layer, fed its own output (vLLM does the
same; as there, the embedding of the pair at the sequence's position 0 is zeroed). Rejected
drafts roll back for free (their rows are overwritten); verification (``rejection_sampler``)
keeps outputs exactly those of the target at any temperature.

With ``--load-format dummy`` the layer gets random weights like the target (benchmarks).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.attention.registry import get_attn_backend
from kvserve.config import EngineConfig
from kvserve.layers.attention import attention_layers, bind_attention, bind_kv_cache
from kvserve.spec_decode.eagle import EagleProposer

logger = logging.getLogger("kvserve")


class DeepseekMTPProposer(EagleProposer):
    """``{"method": "deepseek_mtp", "num_speculative_tokens": k}`` on a DeepSeek-V3-family target.

    Extra key: ``mtp_num_blocks`` (KV blocks of the MTP layer's latent pool; default
    ``min(max_num_seqs, 32)`` requests of ``max_model_len`` tokens; a request that finds no
    room gets no drafts that step).

    Raises ValueError at start-up for a target that is not a DeepSeek model, a checkpoint
    without an MTP layer (``num_nextn_predict_layers`` 0), or tensor parallelism.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.world_size > 1:
            raise ValueError("deepseek_mtp speculation runs with one worker (tensor_parallel_size 1) for now")
        super().__init__(config)
        n = config.speculative_config.extra.get("mtp_num_blocks")
        if n is not None:
            if not isinstance(n, int) or n < 2:
                raise ValueError(f"mtp_num_blocks must be an integer >= 2, got {n!r}")
            self.num_blocks = n
            self.free_blocks = list(range(n - 1, 0, -1))  # block 0: padding reads it

    def bind_target(self, target) -> None:
        """Build the MTP layer of ``target``'s checkpoint (its embedding and rotary shared),
        load its weights (random for ``--load-format dummy``), give it its latent KV pool."""
        from kvserve.models.deepseek_mtp import DeepseekMTP, iterate_layer_weights
        from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM
        from kvserve.worker.model_runner import torch_dtype

        if not isinstance(target, DeepseekV2ForCausalLM):
            raise ValueError(f"deepseek_mtp needs a DeepSeek-V3-family target (DeepseekV3ForCausalLM), got "
                             f"{type(target).__name__}")
        mc = self.config.model_config
        with torch.device(self.device):
            head = DeepseekMTP(target.config, torch_dtype(mc.dtype), target.model.rotary_emb)
        if mc.load_format == "dummy":
            from kvserve.model_loader.dummy_loader import init_dummy_weights

            init_dummy_weights(head, mc.seed + 1)
        elif mc.load_format != "safetensors":
            raise ValueError(f"deepseek_mtp reads the MTP layer from an HF safetensors checkpoint, got load_format "
                             f"{mc.load_format!r}")
        else:
            head.load_weights(iterate_layer_weights(mc.model, head.layer_index))
        head.share_target(target)
        self.head, self.target = head.eval(), target
        self.feature_size = target.config.hidden_size
        backend = self.head_backend = get_attn_backend(self.config.attention_backend)
        bind_attention(head, backend)
        layer = attention_layers(head)[0]
        spec = layer.kv_cache_spec(self.block_size, self.config)
        cache = backend.allocate_kv_cache(spec, self.num_blocks, self.device)
        bind_kv_cache(head, {layer.layer_idx: cache}, specs={layer.layer_idx: spec})
        logger.info("DeepSeek MTP layer %d: %d latent KV blocks of %d tokens (%s)", head.layer_index,
                    self.num_blocks, self.block_size, spec.type_name)

    def _graph_ready(self, rows) -> bool:
        """The draft graphs never zero an embedding: a row whose first new pair sits at the
        sequence's position 0 drafts eagerly (the first step after a prefill, which is eager anyway)."""
        if any(st.base == 0 and st.n == 0 for _, st, *_rest in rows):
            return False
        self.head.first_position_rows = None
        return True

    def _forward(self, rows, ids, pos: np.ndarray, hidden: torch.Tensor, qlens: list[int],
                 seq_lens: list[int]) -> torch.Tensor:
        """``EagleProposer._forward``, telling the layer which rows sit at the sequence's
        position 0 (pair ``(h_0, t_1)``: its embedding is zeroed, as vLLM / SGLang do)."""
        base = np.repeat(np.asarray([st.base for _, st, *_rest in rows], dtype=np.int64), qlens)
        first = np.flatnonzero(base + np.asarray(pos) == 0)
        self.head.first_position_rows = torch.from_numpy(first).to(self.device) if len(first) else None
        return super()._forward(rows, ids, pos, hidden, qlens, seq_lens)
