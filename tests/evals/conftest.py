"""The planted-defect suite's real model, built once per session: Gemma 3 270M cut to the token ids of
tests/evals/fixtures/gemma3_planted.json (`gguf_slice.gemma3_subvocab`, float32, ~3 s) and its carryable
slice (`gguf_slice.write_slice`, ~2 s), both from the session's `gemma3_gguf` (tests/conftest.py).

Shared: a test that patches or casts the model works on `copy.deepcopy(gemma3_subvocab_model)`; the
slice's folder is read only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swiglu_patch.evals.power import FIXTURE, load_fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def planted_data() -> dict:
    """The fixture's token ids and their sorted distinct ``vocab`` (`power.load_fixture`). Read only."""
    return load_fixture(ROOT / FIXTURE)


@pytest.fixture(scope="session")
def gemma3_subvocab_model(gemma3_gguf, planted_data):
    """`gemma3_subvocab(gemma3_gguf, planted_data["vocab"], torch.float32)`: all 18 layers, 2,497 tokens."""
    from swiglu_patch.evals.gguf_slice import gemma3_subvocab

    return gemma3_subvocab(gemma3_gguf, planted_data["vocab"], torch.float32)


@pytest.fixture(scope="session")
def gemma3_slice(gemma3_gguf, planted_data, tmp_path_factory) -> Path:
    """A folder of `write_slice(gemma3_gguf, planted_data["vocab"], ...)`'s pieces and slice.json."""
    from swiglu_patch.evals.gguf_slice import write_slice

    out = tmp_path_factory.mktemp("gemma3_slice")
    write_slice(gemma3_gguf, planted_data["vocab"], out)
    return out
