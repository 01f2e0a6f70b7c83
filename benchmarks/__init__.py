"""Benchmarks of swiglu-patch, each a command (`python -m benchmarks.<name>`): `bench_mlp`,
`bench_e2e`, `bench_host`, `bench_train`, `bench_train_step`, `bench_lora`, `bench_tp`, `tune`,
`summarize`, `accuracy_gemma3`; their shared code in `harness/`, results of record in `results/`.
See README.md."""

import os
import sys

if sys.argv[:1] == ["-m"] and "--dry-run" in sys.argv[1:]:
    # `python -m benchmarks.<name> --dry-run` (sys.argv[0] is "-m" while the package imports): the dry
    # runs run the kernels in Triton's interpreter, which Triton reads when it is imported (torch
    # imports it), before the command's own module runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")
