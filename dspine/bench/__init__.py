"""Benchmarks: acceptance, serving, dynamic verification, sampling, kernels and ReplaySSM. Each
module prints a table and writes JSON under `benchmarks/results/`."""
