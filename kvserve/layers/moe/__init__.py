"""Mixture-of-experts layers: routing (``routing``) and the fused expert layer (``layer``)."""

from kvserve.layers.moe.layer import FusedMoE, fused_experts_torch, moe_activation
from kvserve.layers.moe.routing import select_experts

__all__ = ["FusedMoE", "fused_experts_torch", "moe_activation", "select_experts"]
