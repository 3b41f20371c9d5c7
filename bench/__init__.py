"""memopt benchmarks: `python -m bench` runs the default comparison."""
