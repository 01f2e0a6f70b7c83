"""Benchmarks of swiglu-patch, each a command (`python -m benchmarks.<name>`): `bench_mlp`,
`bench_e2e`, `bench_host`, `tune`, `summarize`; their shared code in `harness/`, frozen one-off
experiments in `studies/`, results of record in `results/`. See README.md."""
