"""Checks of a run that need no model and no heavy import: they fail in well under a second.

`preflight` says, before anything loads or is written, whether the model's source can be
read now (a local path that exists, or a hub id the hub or the local cache can serve) and
whether the fused backend can run on the device. `run_eval` calls it first; the command line
calls it before importing the harness, so a bad ``--model`` or ``--backend`` fails at once.
"""

from __future__ import annotations

import os
from pathlib import Path

from swiglu_patch.inputs import SourceError, check_source

from .config import EvalConfig
from .errors import EvalSetupError


def preflight(model, config: EvalConfig, device: str | None = None, backend: str | None = None) -> None:
    """Check the model's source and the backend against the device.

    Args:
        model: a local folder or hub id (checked), or a loaded model (its source is not checked).
        config: the run.
        device: the device of a loaded model (default: ``config.load.device``, else cuda when
            available).
        backend: the fused backend that will run (default ``config.load.backend``).

    Raises:
        EvalSetupError: the folder does not exist, the hub id cannot be fetched now, the GGUF
            file is missing, or the Triton backend is asked for off CUDA without the interpreter.
    """
    load = config.load
    if isinstance(model, (str, Path)):
        try:
            check_source(str(model), option="--model", what="model")
        except SourceError as err:
            raise EvalSetupError(str(err)) from None
        folder = Path(model).expanduser()
        if load.gguf_file and folder.is_dir() and not (folder / load.gguf_file).is_file():
            raise EvalSetupError(f"--gguf-file {load.gguf_file}: no such file in {model}")
    backend = backend or load.backend
    if backend == "triton":
        check_backend(backend, device or load.device or _default_device())


def check_backend(backend: str, device: str) -> None:
    """Raise EvalSetupError for the Triton backend off CUDA without Triton's interpreter, or with an
    interpreter that cannot run the kernels (one tiny call of the op, which names why)."""
    if backend != "triton" or device.startswith("cuda"):
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise EvalSetupError(
            f"--backend triton on {device} needs Triton's interpreter: set TRITON_INTERPRET=1 (slow; with "
            "--dtype float32), run on a CUDA device, or use --backend auto (the PyTorch reference off CUDA)"
        )
    import torch

    from swiglu_patch import gated_linear, pack_gate_up
    from swiglu_patch.inputs import one_line

    weight = torch.ones(16, 16)
    try:  # one tiny call: the op names what keeps the interpreter from running the kernels
        gated_linear(torch.ones(1, 16), pack_gate_up(weight, weight), backend="triton")
    except RuntimeError as err:
        raise EvalSetupError(f"--backend triton on {device}: {one_line(err)}; or use --backend auto") from None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
