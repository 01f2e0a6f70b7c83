"""Benchmarks of swiglu-patch, each a command (`python -m benchmarks.<name>`): `bench_mlp`,
`bench_e2e`, `bench_host`, `bench_train`, `bench_train_step`, `bench_lora`, `bench_tp`, `tune`,
`summarize`, `accuracy_gemma3`; their shared code in `harness/`, results of record in `results/`.
See README.md."""
