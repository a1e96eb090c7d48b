"""Benchmarks run by ``kvserve bench ...``.

``BENCH_SUBCOMMANDS`` lists one registration function per ``kvserve bench`` subcommand
(same pattern as ``kvserve.entrypoints.cli.SUBCOMMANDS``).
"""

from kvserve.bench.accuracy import register_accuracy
from kvserve.bench.latency import register_latency
from kvserve.bench.serve import register_serve_bench
from kvserve.bench.throughput import register_throughput

BENCH_SUBCOMMANDS = [register_throughput, register_latency, register_serve_bench, register_accuracy]

__all__ = ["BENCH_SUBCOMMANDS"]
