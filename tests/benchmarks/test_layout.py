"""benchmarks/: the benchmarks a user runs at the top, their harness below them. Imports point
down (a top-level benchmark imports the harness, never the reverse), and there are no one-off
studies in the tree: their conclusions are in docs/history.md, their files in git."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
REPO = BENCH.parent
TOP_LEVEL = {"bench_mlp", "bench_e2e", "bench_host", "tune", "summarize", "accuracy_gemma3", "bench_train",
             "bench_train_step", "bench_tp", "bench_lora", "bench_moe", "bench_routing", "bench_e2e_moe", "bench_moe_train", "bench_moe_train_step", "bench_moe_lora",
             "bench_moe_parallel"}


def _imports(path: Path) -> set[str]:
    """Absolute names of the benchmarks modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            out |= {stem} | {f"{stem}.{a.name}" for a in node.names}
    return {name for name in out if name.startswith("benchmarks")}


def test_the_benchmarks_a_user_runs_are_at_the_top():
    found = {p.stem for p in BENCH.glob("*.py")} - {"__init__"}
    assert found <= TOP_LEVEL, f"{sorted(found - TOP_LEVEL)}: a module at the top of benchmarks/ is a command; shared code goes in harness/"
    assert "bench_mlp" in found and "tune" in found


def test_the_harness_imports_no_benchmark():
    for path in (BENCH / "harness").glob("*.py"):
        up = {n for n in _imports(path) if n.split(".")[1:2] and n.split(".")[1] in TOP_LEVEL}
        assert not up, f"{path.name} imports {up}: the harness must not import a benchmark"


def test_no_studies_in_the_tree():
    assert not list(BENCH.glob("studies/**/*.[pm][yd]")), "one-off studies go to docs/history.md (conclusion) and git (files)"
