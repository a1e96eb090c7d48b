"""Serving metrics. ``kvserve.metrics.prometheus`` (needs ``prometheus-client``) exports
vLLM's metric names with a ``kvserve:`` prefix; it is imported by the API server only."""
