"""KV connectors: the seam between the device KV cache and other tiers / engines.

``make_kv_connector(config, role, kv_cache_config)`` returns the configured connector or
None: ``--kv-offloading-size`` selects the CPU tier (``OffloadingConnector``); otherwise
``--kv-transfer-config {"kv_connector": NAME}`` names a registered class.
"""

from __future__ import annotations

from typing import Optional

from kvserve.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

_REGISTRY = {"OffloadingConnector": ("kvserve.kv_connector.offloading", "OffloadingConnector")}

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "make_kv_connector"]


def make_kv_connector(config, role: KVConnectorRole, kv_cache_config) -> Optional[KVConnectorBase_V1]:
    """The connector for ``config`` in ``role``, or None. Raises ValueError for an unknown name."""
    name = None
    if config.cache_config.kv_offloading_size:
        name = "OffloadingConnector"
    elif config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector:
        name = config.kv_transfer_config.kv_connector
    if name is None:
        return None
    if name not in _REGISTRY:
        raise ValueError(f"unknown kv_connector {name!r}; known: {sorted(_REGISTRY)}")
    import importlib

    mod, cls = _REGISTRY[name]
    return getattr(importlib.import_module(mod), cls)(config, role, kv_cache_config)
