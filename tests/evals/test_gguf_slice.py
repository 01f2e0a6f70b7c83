"""The carryable slice of the planted-defect model: pieces that rebuild `gemma3_subvocab`'s model bit
for bit, and refusals that say which piece is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from swiglu_patch.evals.gguf_slice import (
    MANIFEST, gemma3_from_slice, main, read_slice, read_tensors, write_gguf, write_slice)
from swiglu_patch.evals.power import FIXTURE, load_fixture

ROOT = Path(__file__).resolve().parents[2]


def test_write_gguf_round_trip(tmp_path):
    pytest.importorskip("gguf")
    tensors = {
        "a.weight": (0, (3, 5), np.arange(15, dtype=np.float32).reshape(3, 5).view(np.uint8)),  # F32
        "b.weight": (8, (2, 64), np.arange(2 * 68, dtype=np.uint8).reshape(2, 68) % 251),  # Q8_0: 34 bytes / 32
    }
    write_gguf(tmp_path / "t.gguf", tensors)
    back = read_tensors(tmp_path / "t.gguf")
    assert list(back) == list(tensors)
    for name, (qtype, shape, data) in tensors.items():
        assert back[name][:2] == (qtype, shape) and np.array_equal(back[name][2], data)
    assert read_tensors((tmp_path / "t.gguf").read_bytes()).keys() == back.keys()


@pytest.mark.slow
@pytest.mark.real_model
def test_the_slice_rebuilds_the_sub_vocabulary_model_bit_for_bit(gemma3_gguf, gemma3_subvocab_model, tmp_path):
    """`gemma3_subvocab_model` (tests/evals/conftest.py) is `gemma3_subvocab(gemma3_gguf, vocab)`."""
    vocab = load_fixture(ROOT / FIXTURE)["vocab"]
    assert main(["--out", str(tmp_path), "--gguf", str(gemma3_gguf), "--fixture", str(ROOT / FIXTURE), "--piece-mb", "30"]) == 0
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    sizes = [p["bytes"] for p in manifest["pieces"]]
    assert len(sizes) == 3 and max(sizes) <= 30e6 and 65e6 < sum(sizes) < 75e6, sizes  # layers ~68 MB, rows ~1.7 MB
    assert manifest["vocab"] == vocab
    model, got_vocab = gemma3_from_slice(tmp_path)
    assert got_vocab == vocab
    expected = gemma3_subvocab_model.state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected), [k for k in expected if not torch.equal(state[k], expected[k])]


def test_a_missing_or_wrong_piece_is_named(tmp_path):
    pytest.importorskip("gguf")
    tensors = {"x.weight": (0, (4, 4), np.ones((4, 4), np.float32).view(np.uint8)),
               "token_embd.weight": (0, (8, 4), np.arange(32, dtype=np.float32).reshape(8, 4).view(np.uint8))}
    write_gguf(tmp_path / "src.gguf", tensors)
    paths = write_slice(tmp_path / "src.gguf", [5, 1], tmp_path / "s", piece_mb=1e-4)  # 100-byte pieces
    assert len(paths) > 3 and paths[-1].name == MANIFEST
    blob, vocab = read_slice(tmp_path / "s")
    assert vocab == [5, 1]
    rows = read_tensors(blob)["token_embd.weight"]
    assert rows[1] == (2, 4) and np.array_equal(rows[2].view(np.float32), [[20, 21, 22, 23], [4, 5, 6, 7]])
    paths[1].write_bytes(paths[1].read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"gemma3_subvocab.gguf.01: sha256 differs.*copy it again"):
        read_slice(tmp_path / "s")
    paths[1].unlink()
    with pytest.raises(ValueError, match=r"piece gemma3_subvocab.gguf.01 is missing; copy all"):
        read_slice(tmp_path / "s")
    with pytest.raises(ValueError, match="no slice.json"):
        read_slice(tmp_path)


def test_slice_command_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--gguf", str(tmp_path / "none.gguf"), "--fixture", str(ROOT / FIXTURE)]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("python -m swiglu_patch.evals.gguf_slice: error:") and "none.gguf" in err[0]


def test_slice_command_without_gguf_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # import gguf raises ImportError
    assert main(["--out", str(tmp_path / "out"), "--gguf", str(tmp_path / "model.gguf"), "--fixture", str(ROOT / FIXTURE)]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and "real-model extra" in err[0] and "pip install -e '.[real-model]'" in err[0], err
