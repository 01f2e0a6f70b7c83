"""benchmarks/bench_e2e_moe.py on CPU: the dry run exercises every part (prefill, generate with
both caches and the capture check, the profile with the experts marked, routing agreement) on
tiny models of transformers' Qwen3-MoE and gpt-oss classes, the report renders from the JSON
alone, the targets are judged as the issue states them, and bad arguments are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_e2e_moe
from benchmarks.harness.report_e2e_moe import targets

SMALL = ["--rounds", "1", "--prefill", "16", "--new-tokens", "3", "--batches", "1", "--profile-batches", "1"]


def _dry_run(tmp_path, model: str, *extra) -> dict:
    argv = ["--dry-run", "--out", str(tmp_path), "--commit", "abc123", "--models", model, *SMALL, *extra]
    assert bench_e2e_moe.main(argv) == 0
    name, _, layers = model.partition(":")
    return json.loads((tmp_path / f"{name}-{layers}l" / "results.json").read_text())


def test_dry_run_of_qwen3_moe_every_part(tmp_path):
    data = _dry_run(tmp_path, "qwen3-30b-a3b:2", "--static-batches", "1")
    assert data["kind"] == "bench_e2e_moe" and data["env"]["git"]["commit"] == "abc123"
    m = data["model"]
    assert (m["model_type"], m["layers"], m["experts"], m["top_k"], m["default_experts"]) == (
        "qwen3_moe", 2, 8, 2, "grouped_mm")
    assert "2 MoE experts module(s)" in data["patch_report"]
    assert [p["prompt"] for p in data["prefill"]] == [16]
    assert [(g["cache"], g["batch"]) for g in data["generate"]] == [("dynamic", 1), ("static", 1)]
    for g in data["generate"]:
        assert g["equal_leading"] == [3]  # fp32: the two paths pick the same tokens
        assert len(g["eager"]["rounds_s"]) == 1 and g["patched"]["per_s"] > 0
    capture = data["capture"][0]
    for mode in ("eager", "patched"):
        # transformers compiles a static cache's forward on CUDA only: nothing captured here
        assert capture[mode]["graph_replays"] == 0 and capture[mode]["first_call_s"] > 0
    profiled = {(r["cache"], r["batch"]): r for r in data["profile"]}
    assert set(profiled) == {("dynamic", 1), ("static", 1)}
    for mode in ("eager", "patched"):
        assert profiled["dynamic", 1][mode]["mlp_calls"] == 2 * 3  # each experts module: the prompt, 2 steps
        assert profiled["static", 1][mode]["mlp_calls"] == 0
    (pre,) = data["prefill_profile"]
    assert pre["prompt"] == 16 and all(pre[mode]["mlp_calls"] == 2 for mode in ("eager", "patched"))
    a = data["agreement"]
    assert a["top1_agree"] == 1.0 and a["routing_differs"] < 0.05
    load = a["routing_load"]
    assert len(load["busiest_over_mean"]) == 2 and all(1.0 <= b <= 8 / 2 for b in load["busiest_over_mean"])
    assert load["pairs_per_layer"] == 16 * 2 and all(2 <= n <= 8 for n in load["experts_used"])
    # watched rows: 2 calls per mode (the untimed first one and 1 round), each a prompt and 2 decode steps
    for mode in ("eager", "patched"):
        w = data["generate"][0]["watch"][mode]
        assert (w["prompts"], w["steps"], len(data["generate"][0]["watch"]["free_gib"])) == (2, 4, 2)
        assert w["step_ms"]["median"] > 0 and w["gap_ms"]["median"] > 0 and w["alloc_retries"] == 0
        assert 0 < w["marked_ms"]["median"] < w["step_ms"]["median"]  # the experts: part of a step's host time
        w = data["prefill"][0]["watch"][mode]
        assert (w["prompts"], w["steps"], w["gap_ms"]["median"]) == (2, 0, None)
    assert set(data["generate"][1]["watch"]) == {"all", "free_gib"}  # the static row: no hooks
    md = (tmp_path / "qwen3-30b-a3b-2l" / "results.md").read_text()
    for heading in ("## Against the targets", "## Prefill", "## Where a prefill's time goes", "## HF generate",
                    "## Does the static-cache step capture?", "## Where a decode step's time goes",
                    "## Host, collector and allocator per row", "## Agreement"):
        assert heading in md
    assert "dry run on CPU" in md and "abc123" in md and "all 1 equal" in md
    (tmp_path / "qwen3-30b-a3b-2l" / "results.md").unlink()
    assert bench_e2e_moe.main(["--render", str(tmp_path / "qwen3-30b-a3b-2l" / "results.json")]) == 0
    assert (tmp_path / "qwen3-30b-a3b-2l" / "results.md").read_text() == md


def test_dry_run_of_gpt_oss_generate_only(tmp_path):
    data = _dry_run(tmp_path, "gpt-oss-20b:2", "--parts", "generate", "--static-batches", "--batches", "2")
    assert data["model"]["model_type"] == "gpt_oss" and data["model"]["attn"] == "eager"
    assert [(g["cache"], g["batch"]) for g in data["generate"]] == [("dynamic", 2)]
    assert data["generate"][0]["equal_leading"] == [3, 3]  # every sequence checked; fp32: the same tokens
    a = data["agreement"]
    assert a["top1_agree"] == 1.0 and a["routing_differs"] == 0.0 and a["rel_logit_diff"] < 1e-5
    assert not {"prefill", "prefill_profile", "capture", "profile"} & set(data)


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    def cut(*args, **kwargs):
        raise RuntimeError("cut by the time limit")

    monkeypatch.setattr(bench_e2e_moe.bench_e2e, "measure_generate", cut)
    with pytest.raises(RuntimeError, match="cut by the time limit"):
        _dry_run(tmp_path, "qwen3-30b-a3b:2", "--parts", "prefill", "generate")
    data = json.loads((tmp_path / "qwen3-30b-a3b-2l" / "results.json").read_text())
    assert [p["prompt"] for p in data["prefill"]] == [16] and "generate" not in data
    assert data["agreement"]["top1_agree"] == 1.0 and data["agreement"]["routing_differs"] < 0.05


def test_a_run_cut_while_the_default_compiles_keeps_the_patched_capture(tmp_path, monkeypatch):
    entered = []

    class Cut(bench_e2e_moe._GraphReplays):
        def __enter__(self):
            entered.append(1)
            if len(entered) == 2:  # the second mode's counted call
                raise RuntimeError("cut by the time limit")
            return super().__enter__()

    monkeypatch.setattr(bench_e2e_moe, "_GraphReplays", Cut)
    with pytest.raises(RuntimeError, match="cut by the time limit"):
        _dry_run(tmp_path, "qwen3-30b-a3b:2", "--parts", "generate", "--batches", "--static-batches", "1")
    data = json.loads((tmp_path / "qwen3-30b-a3b-2l" / "results.json").read_text())
    (row,) = data["capture"]
    assert set(row) == {"batch", "patched"} and row["patched"]["first_call_s"] > 0
    assert "| 1 | default | not reached |" in bench_e2e_moe.render_markdown(data)


def test_the_patched_copy_shares_the_weights_not_the_config():
    spec = bench_e2e_moe.TINY["qwen3-30b-a3b"]
    base = bench_e2e_moe.build_model(spec, 2, torch.device("cpu"), torch.float32, 0)
    twin = bench_e2e_moe.sharing_copy(base)
    assert all(a is b for a, b in zip(base.parameters(), twin.parameters()))
    assert twin.config is not base.config
    assert all(e.config is twin.config for e in bench_e2e_moe.experts_modules(twin))
    assert len(bench_e2e_moe.experts_modules(twin)) == 2


def test_routing_differs_counts_changed_expert_sets():
    a = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[4, 5], [6, 7]])]
    b = [torch.tensor([[1, 0], [2, 4]]), torch.tensor([[4, 5], [6, 7]])]  # same set reordered; one changed
    assert bench_e2e_moe.routing_differs(a, b) == 0.25


def _gen(cache, batch, eager_s, patched_s):
    return {"cache": cache, "batch": batch, "eager": {"per_s": eager_s}, "patched": {"per_s": patched_s},
            "speedup": {"median": patched_s / eager_s, "min": 0.9 * patched_s / eager_s}}


def test_targets_as_the_issue_states_them():
    data = {"prefill": [{"prompt": 2048, "speedup": {"median": 1.6, "min": 1.4}}],
            "generate": [_gen("dynamic", 1, 100, 120), _gen("dynamic", 8, 400, 640), _gen("dynamic", 32, 1000, 900),
                         _gen("static", 1, 150, 290), _gen("static", 8, 500, 600)]}
    got = {r["what"]: (round(r["ratio"], 3), r["target"], r["verdict"].split(" (")[0]) for r in targets(data)}
    assert got == {
        "prefill 2048 tokens": (1.6, 1.5, "met"),
        "dynamic cache, batch 1": (1.2, 1.3, "**missed**"),
        "dynamic cache, batch 8": (1.6, 1.5, "met"),
        "dynamic cache, batch 32": (0.9, 1.5, "**missed**"),
        "static cache, batch 1: patched static / default static": (1.933, None, "met"),
        # against the default's best decode over both caches: 150 tok/s (static) beats 100 (dynamic)
        "static cache, batch 1: patched static / default's best decode": (1.933, 2.0, "**missed**"),
        "static cache, batch 8: patched static / default static": (1.2, None, "met"),
        "static cache, batch 8: patched static / default's best decode": (1.2, None, "met"),
    }


def test_bounds_from_the_gpu_time_saved_and_the_experts_host_time():
    from benchmarks.harness.report_e2e_moe import _bounds

    def mode(wall, gpu, host):
        return {"wall_ms": wall, "gpu_ms": gpu, "mlp_host_ms": host}

    data = {"generate": [{"cache": "dynamic", "batch": 1, "new_tokens": 10, "eager": {"median_s": 0.1},
                          "speedup": {"median": 1.04}}],
            "profile": [{"cache": "dynamic", "batch": 1, "eager": mode(20.0, 2.0, 4.0), "patched": mode(19.0, 1.5, 3.0)}]}
    # step 10 ms, 0.5 ms of GPU saved: 10 / 9.5; the experts' host time free: 20 / 16
    assert "| dynamic | 1 | 10.00 | 0.500 | 1.053x | 1.250x | 1.040x |" in "\n".join(_bounds(data))


@pytest.mark.parametrize("argv,message", [
    (["--dry-run"], "--out is required"),
    (["--dry-run", "--out", "X", "--models", "mixtral"], "unknown model 'mixtral'; choose from gpt-oss-20b, "
                                                          "qwen3-30b-a3b"),
    (["--dry-run", "--out", "X", "--models", "gpt-oss-20b:0"], "expected an integer >= 1, got '0'"),
    (["--out", "X", "--models", "qwen3-30b-a3b:49"], "--models qwen3-30b-a3b:49: Qwen3-30B-A3B has 48 layers"),
    (["--dry-run", "--out", "X", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--render", "missing.json"], "missing.json: no such file"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench_e2e_moe.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_render_refuses_another_kind(tmp_path, capsys):
    (tmp_path / "dense.json").write_text(json.dumps({"kind": "bench_e2e", "schema": 2}))
    with pytest.raises(SystemExit) as e:
        bench_e2e_moe.main(["--render", str(tmp_path / "dense.json")])
    assert e.value.code == 2 and "not a bench_e2e_moe results JSON" in capsys.readouterr().err
