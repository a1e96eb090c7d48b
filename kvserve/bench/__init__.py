"""Benchmarks run by ``kvserve bench ...``.

``BENCH_SUBCOMMANDS`` lists one registration function per ``kvserve bench`` subcommand
(same pattern as ``kvserve.entrypoints.cli.SUBCOMMANDS``).
"""

from kvserve.bench.throughput import register_throughput

BENCH_SUBCOMMANDS = [register_throughput]

__all__ = ["BENCH_SUBCOMMANDS"]
