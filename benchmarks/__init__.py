"""Benchmarks of swiglu-patch: `python -m benchmarks.bench_mlp` (the gated GEMM against
cuBLAS, HF eager, torch.compile and Liger) and `python -m benchmarks.bench_e2e` (prefill and
decode tokens/s of a Llama-3-8B-shaped model, eager against patched). See README.md."""
