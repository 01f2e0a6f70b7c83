"""What ran where: machine, library versions and the swiglu-patch commit, for every report."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import sys
from pathlib import Path


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(start: Path | None = None) -> str:
    """HEAD of the repository holding this package, with ``+dirty`` for local changes;
    "unknown" outside a git checkout (e.g. an installed wheel)."""
    here = start or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown (no commit)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_sha256() -> str:
    """sha256 over the .py files of swiglu_patch, swiglu_patch.kernels and swiglu_patch.evals
    (path and bytes, in path order): ties a result to the exact code, committed or not."""
    import hashlib
    import importlib

    h = hashlib.sha256()
    for pkg in ("swiglu_patch", "swiglu_patch.kernels", "swiglu_patch.evals"):
        root = Path(importlib.import_module(pkg).__file__).parent
        for f in sorted(root.glob("*.py")):
            h.update(f"{pkg}/{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def environment(device: str | None = None) -> dict:
    """{machine, python, torch, transformers, lm_eval, triton, commit, ...} as strings."""
    import torch

    machine = f"{_cpu_name()}, {os.cpu_count()} CPUs"
    if device and device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        machine = f"{torch.cuda.get_device_name(idx)} (CUDA {torch.version.cuda}); host {machine}"
    return {
        "machine": machine,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "lm_eval": _version("lm_eval"),
        "triton": _version("triton"),
        "swiglu_patch": _version("swiglu-patch"),
        "commit": git_commit(),
        "code_sha256": code_sha256(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
