"""Benchmarks of the lifecycle library: run each as ``python -m benchmarks.<name> --help``."""
