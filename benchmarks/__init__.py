"""Benchmarks: each step of the pipeline against a re-implementation of its anchor.

``python -m benchmarks all [--smoke] [--out FILE]`` or ``python -m benchmarks NAME``; see
benchmarks/README.md.
"""
