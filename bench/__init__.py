"""memopt benchmarks: `python -m bench` compares training configurations (bench/compare.py),
`python -m bench.kernels` times single ops, `python -m bench.plot` re-draws plots from results."""

from bench import _setup  # noqa: F401  (before memopt is imported: chooses how Triton kernels run)
