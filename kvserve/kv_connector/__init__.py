"""KV connectors: the seam between the device KV cache and other tiers / engines.

``make_kv_connector(config, role, kv_cache_config)`` returns the configured connector or
None: ``--kv-offloading-size`` selects the CPU tier (``OffloadingConnector``); otherwise
``--kv-transfer-config {"kv_connector": NAME}`` names a registered class.
"""

from __future__ import annotations

from typing import Optional

from kvserve.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

_REGISTRY = {"OffloadingConnector": ("kvserve.kv_connector.offloading", "OffloadingConnector"),
             "P2PKVConnector": ("kvserve.kv_connector.p2p.connector", "P2PKVConnector")}

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "make_kv_connector",
           "prepare_kv_connector_config"]


def _connector_class(config):
    name = None
    kvt = config.kv_transfer_config
    if config.cache_config.kv_offloading_size and kvt is not None and kvt.kv_connector \
            and kvt.kv_connector != "OffloadingConnector":
        raise ValueError(f"--kv-offloading-size and --kv-transfer-config kv_connector {kvt.kv_connector!r} "
                         "cannot be combined (one KV connector per engine)")
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
    return getattr(importlib.import_module(mod), cls)


def prepare_kv_connector_config(config) -> None:
    """Let the configured connector resolve start-up values in ``config`` (ports, ids) once,
    before workers start. Raises ValueError for an unknown name or a bad connector config."""
    cls = _connector_class(config)
    if cls is not None:
        cls.prepare_config(config)


def make_kv_connector(config, role: KVConnectorRole, kv_cache_config) -> Optional[KVConnectorBase_V1]:
    """The connector for ``config`` in ``role``, or None. Raises ValueError for an unknown name."""
    cls = _connector_class(config)
    return None if cls is None else cls(config, role, kv_cache_config)
