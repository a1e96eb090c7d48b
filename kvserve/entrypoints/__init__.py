"""User-facing entry points: the ``kvserve`` command line (``kvserve.entrypoints.cli``)."""
