"""Disaggregated prefill/decode: KV transfer between engines over TCP or NIXL (``P2PKVConnector``)."""

from kvserve.kv_connector.p2p.connector import P2PKVConnector

__all__ = ["P2PKVConnector"]
