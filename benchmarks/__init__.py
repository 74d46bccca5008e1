"""Developer benchmarks, run from the repository root on a GPU machine (`python -m benchmarks.NAME`):
the kernel micro-benchmarks (bench_*.py), the engine step's (micro.py, profile_step.py) and
speculative decoding's (spec.py). `e2e/latest.json` is the last `salaserve bench e2e` result.

They import salaserve; nothing in salaserve imports them.
"""
