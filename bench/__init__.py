"""Benchmarks, simulators and compile checks: developer tooling, never imported by the
runtime packages (proxy, engine, billing, web). Scripts run as ``python bench/<name>.py``
from the repository root; ``kvtoll bench`` is :mod:`bench.cli`."""
