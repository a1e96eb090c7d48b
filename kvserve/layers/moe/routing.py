"""Expert selection for mixture-of-experts layers: router logits -> (weights, expert ids) per token.

Conventions follow the published models (and transformers' reference code):

- ``softmax`` scoring (Mixtral, Qwen2/3-MoE, gpt-oss): probabilities over all experts, the
  top-k kept, renormalized to sum to 1 when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``,
  Mixtral, gpt-oss; gpt-oss's "softmax over the selected logits" is the same thing).
- ``sigmoid`` scoring (DeepSeek-V3's ``noaux_tc``, arXiv:2412.19437): scores ``sigmoid(logits)``;
  selection uses ``scores + e_score_correction_bias`` but the weights are the unbiased scores.
- group-limited selection (DeepSeek-V2/V3, ``n_group`` / ``topk_group``): experts are split
  into groups, only the best ``topk_group`` groups compete (a group's score: its max for
  softmax, the sum of its top-2 biased scores for sigmoid).
- ``routed_scaling_factor`` multiplies the final weights.

Ties are broken as ``torch.topk`` breaks them, which is what transformers uses (its order among
equal scores is unspecified); the Triton routing kernel on CUDA (``triton_moe.topk_softmax``)
takes the lower expert id.
"""

from __future__ import annotations

from typing import Optional

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` (any float dtype; computed in float32).
        top_k: experts per token (1 <= top_k <= E).
        renormalize: rescale each token's kept weights to sum to 1.
        scoring_func: ``softmax`` or ``sigmoid``.
        e_score_correction_bias: ``[E]`` added to the scores for selection only (sigmoid routing).
        num_expert_group, topk_group: group-limited selection (both or neither).
        routed_scaling_factor: multiplies the returned weights.
    Returns:
        ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int32)``.
    Raises:
        ValueError: an unknown scoring function, ``top_k`` outside ``[1, E]``, groups that do not
        divide the experts.
    """
    num_experts = router_logits.shape[-1]
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the number of experts ({num_experts})")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        if num_experts % num_expert_group or not topk_group or topk_group > num_expert_group:
            raise ValueError(f"n_group {num_expert_group} must divide the {num_experts} experts and "
                             f"topk_group {topk_group} must be in [1, n_group]")
        t = choice.shape[0]
        grouped = choice.view(t, num_expert_group, -1)
        if e_score_correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
        mask = mask.unsqueeze(-1).expand_as(grouped).reshape(t, num_experts)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
