"""Model implementations and the architecture registry."""

from kvserve.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
