"""What a result was measured on: GPU, driver, library versions and the git commit."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "triton", "transformers", "liger-kernel", "swiglu-patch")
_REPO_ROOT = Path(__file__).resolve().parent.parent


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


def git_commit(given: str | None) -> dict:
    """The commit the code came from.

    The device machine gets a copy of the working tree, where `git rev-parse HEAD` may fail:
    so `given` (from --commit) wins, git is tried next, and "unknown" says neither worked.

    Returns:
        {"commit": str, "source": "argument" | "git" | "unknown", "dirty": bool | None}
    """
    head = _run(["git", "rev-parse", "HEAD"])
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"]) if head else None
    dirty = None if head is None else bool(status)
    if given:
        return {"commit": given, "source": "argument", "dirty": dirty if head == given else None}
    if head:
        return {"commit": head, "source": "git", "dirty": dirty}
    return {"commit": "unknown", "source": "unknown", "dirty": None}


def gpu_info(device: torch.device) -> dict:
    """GPU name, SM count, memory, CUDA runtime and driver; {"name": "cpu"} on CPU."""
    if device.type != "cuda":
        return {"name": "cpu", "processor": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(device)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"])
    return {
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "cuda_runtime": torch.version.cuda,
        "driver": driver or "unknown (nvidia-smi failed)",
    }


def environment(device: torch.device, commit: str | None) -> dict:
    """Everything a results JSON records about where and from what it was measured."""
    return {
        "gpu": gpu_info(device),
        "versions": {name: package_version(name) for name in PACKAGES} | {"python": platform.python_version()},
        "git": git_commit(commit),
        "host": platform.node(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
