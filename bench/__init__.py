"""Benchmark runner for VoiceChat MLX: streamed-session RTF / p50 / p95 per stage, plots, physical floor.

`voicechat bench -m CKPT --audio in.wav ...` (bench.cli) drives `bench.runner.run_bench`,
which runs every checkpoint x backend x input through the harness backends
(`harness.backends.get_backend`) and writes a run folder (bench.report,
bench.plots); `bench.floor` computes the bytes a frame must read and this
machine's bandwidth; `bench.docs` regenerates docs/performance.md from a folder;
`bench.sessions` (`--sessions N,N,...`) times ticks of N sessions in one session batch.
"""

from .runner import BenchOptions, BenchResult, Progress, run_bench

__all__ = ["BenchOptions", "BenchResult", "Progress", "run_bench"]
