"""Every results path the code and docs cite exists, so a moved or deleted result fails CI.

Scans every .py and .md file of the repository (README.md, docs/, the packages, tests/,
benchmarks/ and the results' own READMEs) for ``benchmarks/results/...`` and checks each
path. Brace lists expand (``{bf16,fp16}_results.json``), globs must match something, and a
path with a placeholder (``<commit>``, ``$OUT``, ``{gpu}``) is checked up to the placeholder,
and a path right after a git revision (``git show 528fc9a:benchmarks/results/...``) is history,
not checked.
The paths the kernel rules cite (`Rule.sweep`, relative to benchmarks/results/) are checked
too, and the results stay under 5 MB. All stale paths are reported at once.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "node_modules", "build", "dist", "__pycache__", ".pytest_cache"}
PATH = re.compile(r"benchmarks/results(?:/[A-Za-z0-9_.*{},<>$-]+)*/?")
PLACEHOLDER = re.compile(r"[<>$]|\{[^,}]*\}")


def _sources() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if path.suffix in (".md", ".py"):
                out.append(path)
    return out


def _expand(path: str) -> list[str]:
    """Brace lists expanded: a/{x,y}_z -> a/x_z, a/y_z."""
    parts = re.split(r"(\{[^{}]*,[^{}]*\})", path)
    choices = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(path: str) -> bool:
    cut = PLACEHOLDER.search(path)
    if cut:  # check the folders before the placeholder
        path = path[: cut.start()].rpartition("/")[0]
    path = path.rstrip(".,:;")
    if any(ch in path for ch in "*?["):
        return bool(glob.glob(str(REPO / path)))
    return (REPO / path).exists()


def cited_paths() -> dict[str, list[str]]:
    """{path as cited: ["file:line", ...]} over the scanned sources."""
    cited: dict[str, list[str]] = {}
    for source in _sources():
        for n, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
            for match in PATH.finditer(line):
                if match.start() and line[match.start() - 1] == ":":  # `git show REV:path`: history
                    continue
                cited.setdefault(match.group(0), []).append(f"{source.relative_to(REPO)}:{n}")
    return cited


def test_every_cited_results_path_exists():
    stale = []
    for path, where in sorted(cited_paths().items()):
        missing = [p for p in _expand(path) if not _exists(p)]
        if missing:
            stale.append(f"{', '.join(missing)}  (cited at {', '.join(where)})")
    assert not stale, f"{len(stale)} results path(s) cited but missing:\n" + "\n".join(stale)


def test_every_sweep_a_rule_cites_exists():
    from swiglu_patch.kernels.rules import RULES

    missing = sorted({p for r in RULES for p in r.sweep if not (REPO / "benchmarks" / "results" / p).is_file()})
    assert not missing, f"rules cite sweeps missing under benchmarks/results/: {missing}"


def test_the_results_of_record_stay_under_5_mb():
    files = [p for p in (REPO / "benchmarks" / "results").rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert total <= 5 * 2**20, (f"benchmarks/results holds {total / 2**20:.1f} MB, over 5 MB: keep results of record "
                                f"only (largest: {[str(p.relative_to(REPO)) for p in largest]})")


def test_the_scanner_expands_and_checks():
    assert _expand("benchmarks/results/h100/mlp/{results,summary}.md") == [
        "benchmarks/results/h100/mlp/results.md", "benchmarks/results/h100/mlp/summary.md"]
    assert _exists("benchmarks/results/h100/mlp/results.md")
    assert _exists("benchmarks/results/h100/tune/tune_*_h100_bf16.json")
    assert _exists("benchmarks/results/h100/mlp/<commit>/results.json")  # checked up to the placeholder
    nowhere = "benchmarks/" + "results/h100/nothing"  # split: the scan of this file must not find it
    assert not _exists(nowhere + "_here.json")
    assert not _exists(nowhere + "_*.json")
    found = [m.group(0) for m in PATH.finditer("see `benchmarks/results/h100/mlp/results.md`, and (x)")]
    assert found == ["benchmarks/results/h100/mlp/results.md"]
