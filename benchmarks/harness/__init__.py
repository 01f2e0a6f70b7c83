"""The shared harness of the benchmarks a user runs (`benchmarks/*.py`): nothing here is run
on its own, and nothing here imports a top-level benchmark.

- `shapes`: the one table of real MLP dimensions (K, I, activation) and token counts;
- `models`: whole-model dimensions (Llama-3-8B, Qwen2.5-7B, a tiny dry-run model) and
  `build_model`;
- `ways`: the ways of computing a gated MLP's first half that `bench_mlp` compares;
- `accuracy`: the float64 check every way passes before it is timed;
- `timing`: GPU timers (CUDA-graph replay after a read-only L2 flush, do_bench, CUDA events
  around eager training steps) and a CPU timer;
- `sweep_ops`: the ops `tune` sweeps (forward, training's forward storing P, its backward GEMM)
  through the public kernel entry points, with their float64 checks;
- `sweep_candidates`: the candidates (kernel name, config) of each `tune` sweep;
- `train_mlps`: the MLP modules `bench_train` trains (HF's class, `gated_mlp` in both modes, Liger's,
  quack's);
- `fwd_bwd`: one forward + backward of a way as a training step, its saved and peak memory, and
  its gradients' errors against float64;
- `host_time`: host time per call from an idle GPU, and rounds of eager-vs-patched turns;
- `roofline`: the floor a gated GEMM cannot beat, and the measured peaks it is built from;
- `report_mlp`: `bench_mlp`'s markdown and PNG, pure functions of its JSON;
- `report_moe_train`: `bench_moe_train`'s markdown (ways, sweeps, each kernel against cuBLAS);
- `decode_graph`: greedy decode with the step captured in a CUDA graph;
- `step_profile`: GPU time of a decode step by kernel family, from torch.profiler;
- `cli`: one-line command-line errors (exit code 2) and JSON output.
"""
