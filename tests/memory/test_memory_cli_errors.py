"""The memory commands' input errors: one line on stderr, exit status 2, nothing written.

Each case is one a new user met: a config.json whose intermediate_size is not an integer or is
negative, a preset's own JSON file passed as --model, and an --out-dir that cannot be a folder.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from swiglu_patch.memory import kv_cli, profile_cli
from swiglu_patch.memory.configs import resolve_model

_FIELDS = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100}


def _run(module, argv, capsys):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    code = module.main(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_line_error(err: str, *needles: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("value", ["abc", 1.5, -5, 0, True])
def test_intermediate_size_that_is_not_a_positive_integer(tmp_path, capsys, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_FIELDS | {"intermediate_size": value}))
    code, out, err = _run(kv_cli, ["--model", str(path), "--gpu", "H100"], capsys)
    assert code == 2 and out == ""
    _one_line_error(err, "kv-capacity: error:", str(path), "intermediate_size must be a positive integer",
                    repr(value), "fix the config.json")


def test_moe_sizes_are_checked_too(tmp_path):
    path = tmp_path / "config.json"
    fields = _FIELDS | {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32}
    path.write_text(json.dumps(fields | {"num_experts_per_tok": "2"}))
    with pytest.raises(ValueError, match="num_experts_per_tok must be a positive integer, got '2'"):
        resolve_model(str(path))
    path.write_text(json.dumps(fields | {"n_shared_experts": -1}))
    with pytest.raises(ValueError, match="n_shared_experts must be an integer >= 0, got -1"):
        resolve_model(str(path))
    path.write_text(json.dumps(fields))
    assert resolve_model(str(path)).shape().moe.intermediate_size == 32


def test_a_preset_file_passed_as_model_is_that_preset(capsys):
    preset = resolve_model("qwen3-30b-a3b")
    from swiglu_patch.memory.configs import _preset_dir

    path = str(_preset_dir().joinpath("qwen3-30b-a3b.json"))
    from_file = resolve_model(path)
    assert (from_file.name, from_file.source) == (preset.name, preset.source)
    assert from_file.shape() == preset.shape()
    by_name = _run(kv_cli, ["--model", "qwen3-30b-a3b", "--tp", "1"], capsys)
    by_path = _run(kv_cli, ["--model", path, "--tp", "1"], capsys)
    assert by_name == by_path and by_name[0] == 0 and "| KV tokens (full count) |" in by_name[1]


def _out_dirs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "missing" / "target")
    return {"a file": (a_file, "a file is in the way"), "under a file": (a_file / "sub", "is a file, not a folder"),
            "broken link": (broken, "a broken symbolic link"), "empty": ("", "--out-dir is empty")}


@pytest.mark.parametrize("case", ["a file", "under a file", "broken link", "empty"])
def test_kv_capacity_out_dir_that_cannot_be_written(tmp_path, capsys, case):
    path, why = _out_dirs(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    code, out, err = _run(kv_cli, ["--model", "llama-3.1-8b", "--out-dir", str(path)], capsys)
    assert code == 2 and out == ""
    _one_line_error(err, "kv-capacity: error: --out-dir", why, "give a folder you can write to")
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("case", ["a file", "under a file", "broken link", "empty"])
def test_memory_out_dir_that_cannot_be_written(tmp_path, capsys, case):
    path, why = _out_dirs(tmp_path)[case]
    code, out, err = _run(profile_cli, ["--model", "llama-3.1-8b", "--tokens", "64", "--out-dir", str(path)], capsys)
    assert code == 2 and out == ""
    _one_line_error(err, "memory: error: --out-dir", why)


def test_memory_refuses_a_prefill_it_cannot_predict_and_predicts_the_experts(capsys):
    code, out, err = _run(profile_cli, ["--model", "deepseek-v3", "--what", "both", "--tokens", "64"], capsys)
    assert code == 2 and out == ""
    _one_line_error(err, "deepseek-v3: HF's attention", "--what mlp")
    # not asked for the prefill: the experts block alone, and a line that says so
    code, out, _ = _run(profile_cli, ["--model", "deepseek-v3", "gpt-oss-20b", "--tokens", "64", "--batch-sizes", "1"],
                        capsys)
    assert code == 0 and "deepseek-v3: HF's attention of this family is not modelled; showing its MLP" in out
    assert "| deepseek-v3 | mlp | 1 | 64 |" in out and "| deepseek-v3 | prefill" not in out
    assert "| gpt-oss-20b | prefill | 1 | 64 |" in out
    code, out, _ = _run(profile_cli, ["--model", "deepseek-v3", "--what", "mlp", "--tokens", "64",
                                      "--batch-sizes", "1", "--layers", "4"], capsys)
    assert code == 0 and "| deepseek-v3 | mlp | 1 | 64 |" in out
    code, out, _ = _run(profile_cli, ["--model", "gpt-oss-20b", "qwen3-30b-a3b", "--tokens", "64", "--batch-sizes", "1"],
                        capsys)
    assert code == 0 and "| gpt-oss-20b | prefill | 1 | 64 |" in out and "| qwen3-30b-a3b | mlp | 1 | 64 |" in out
