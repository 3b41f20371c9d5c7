"""memopt benchmarks: `python -m bench` compares training configurations (bench/compare.py),
`python -m bench.kernels` times single ops, `python -m bench.plot` re-draws plots from results."""
