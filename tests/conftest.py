"""Test setup: the Triton kernel runs on CPU through Triton's interpreter; every test is seeded.

TRITON_INTERPRET must be set before Triton decorates the kernels, so before swiglu_patch is
imported; on a CUDA machine the real kernel runs instead. Tests are grouped by unit
(kernels/, patch/, evals/, memory/, benchmarks/, cli/, distributed/); shared helpers live in
helpers.py, importable from any of them (`from helpers import rel_err`).
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
