"""What a result was measured on: machine, GPU, library versions and the swiglu-patch commit.

One record for every report the project writes (benchmarks, accuracy evals, memory tools):

    {"gpu": {...}, "host": {...}, "versions": {...}, "git": {...}, "date_utc": "..."}

Nothing here imports torch at module import, and nothing imports the packages it versions
(`importlib.metadata` reads their metadata), so recording provenance costs no import time.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

# Distributions whose versions a result depends on (absent ones record None).
PACKAGES = (
    "swiglu-patch", "torch", "triton", "transformers", "accelerate", "peft", "lm_eval", "liger-kernel",
    "quack-kernels",
)
_REPO_ROOT = Path(__file__).resolve().parent.parent
# The device machine gets a copy of the working tree without .git: the commit comes in this variable.
COMMIT_ENV = "SWIGLU_PATCH_COMMIT"


def package_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None; never imports it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=_REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def git_commit(given: str | None = None) -> dict:
    """The commit the code came from.

    `given` (a --commit argument) wins, then the SWIGLU_PATCH_COMMIT environment variable,
    then `git rev-parse HEAD` in the repository holding this package.

    Returns:
        {"commit": str, "source": "argument" | "environment" | "git" | "unknown", "dirty": bool | None}
        (dirty: tracked files differ from the commit; None when git could not tell).
    """
    head = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"]) if head else None
    dirty = None if head is None else bool(status)
    if given:
        return {"commit": given, "source": "argument", "dirty": dirty if head and head.startswith(given) else None}
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "source": "environment", "dirty": None}
    if head:
        return {"commit": head, "source": "git", "dirty": dirty}
    return {"commit": "unknown", "source": "unknown", "dirty": None}


def code_sha256() -> str:
    """sha256 over the .py files of swiglu_patch and its kernels and evals packages (path and
    bytes, in path order): ties a result to the exact code, committed or not."""
    import importlib.util

    h = hashlib.sha256()
    for pkg in ("swiglu_patch", "swiglu_patch.kernels", "swiglu_patch.evals"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for f in sorted(root.rglob("*.py")):
            h.update(f"{pkg}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info(device=None) -> dict:
    """GPU name, SM count, memory, compute capability, CUDA runtime and driver of `device`
    (a torch.device, "cuda:1", ...; None: cuda:0 when CUDA is available); {"name": "cpu"} otherwise."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {"name": "cpu"}
    index = device.index or 0
    props = torch.cuda.get_device_properties(index)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"])
    return {
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "cuda_runtime": torch.version.cuda,
        "driver": driver or "unknown (nvidia-smi failed)",
    }


def environment(device=None, commit: str | None = None) -> dict:
    """Everything a results file records about where and from what it was measured.

    Args:
        device: the device the work ran on (torch.device or string; None: cuda:0 if available).
        commit: the commit, when the caller knows it better than git (see `git_commit`).

    Returns:
        {"gpu": gpu_info, "host": {...}, "versions": {package: version | None, "python": ...},
         "git": git_commit, "code_sha256": ..., "triton_interpret": "0" | "1", "date_utc": ...}
    """
    return {
        "gpu": gpu_info(device),
        "host": {"name": platform.node(), "cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {name: package_version(name) for name in PACKAGES} | {"python": platform.python_version()},
        "git": git_commit(commit),
        "code_sha256": code_sha256(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
