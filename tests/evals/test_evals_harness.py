"""End to end through lm-eval's real evaluator, offline, on a tiny random Llama.

The synthetic fixtures (tests/evals/fixtures/) are in MMLU-Pro's and GPQA's real schemas and are
read by lm-eval's own task YAMLs with only the dataset fields overridden.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

pytest.importorskip("lm_eval")

from helpers import NoisyPatcher, build_byte_tokenizer, build_tiny_llama, save_tiny_llama  # noqa: E402

from swiglu_patch import is_patched  # noqa: E402
from swiglu_patch.evals import EvalConfig, LoadOptions, TaskOptions, TextOptions, run_eval  # noqa: E402
from swiglu_patch.evals.errors import EvalSetupError  # noqa: E402
from swiglu_patch.evals.patching import IdentityPatcher  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MMLU_PRO = f"leaderboard_mmlu_pro={FIXTURES}"
GPQA = f"gpqa_diamond_zeroshot={FIXTURES / 'gpqa_synthetic.csv'}"
CPU32 = LoadOptions(dtype="float32", device="cpu")
slow = pytest.mark.slow  # lm-eval's evaluator eager and fused: 20-70 s each on 2 cores


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _rows(report: dict) -> dict:
    return {(r["task"], r["filter"]): r for r in report["rows"]}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().split("\n") if x.strip()]


@pytest.fixture(scope="module")
def identity_report(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("identity")
    config = EvalConfig(
        output_dir=out, load=CPU32, print_summary=False,
        tasks=TaskOptions(names=("leaderboard_mmlu_pro", "gpqa_diamond_zeroshot"), local_data=(MMLU_PRO, GPQA), batch_size=4),
    )
    report = run_eval(str(tiny_dir), config, patcher=IdentityPatcher())
    return report, out


@slow
def test_identical_model_gives_full_agreement_and_no_flips(identity_report):
    report, out = identity_report
    rows = _rows(report)
    assert set(rows) == {("leaderboard_mmlu_pro", "none"), ("gpqa_diamond_zeroshot", "none")}
    assert rows[("leaderboard_mmlu_pro", "none")]["n"] == 42 and rows[("gpqa_diamond_zeroshot", "none")]["n"] == 24
    for row in rows.values():
        a = row["answers"]
        assert a["answers_same"] == a["n"] and a["answer_agreement"] == 1.0
        assert a["max_abs_loglik_diff"] == 0.0
        for m in row["metrics"].values():
            p = m["paired"]
            assert p["right_to_wrong"] == 0 and p["wrong_to_right"] == 0 and p["mcnemar_p"] == 1.0
            assert m["eager"] == m["fused"] and m["diff"] == 0.0
        assert row["verdict"]["label"] == "no detectable difference"
    assert (out / "report.json").exists() and (out / "report.md").exists()
    assert "no detectable difference" in (out / "report.md").read_text()


@slow
def test_scores_match_an_independent_recount_of_the_samples(identity_report):
    """acc recomputed from the logged log-likelihoods and the fixture's answer key."""
    report, out = identity_report
    rows = _rows(report)
    test_rows = _jsonl(FIXTURES / "mmlu_pro_test.jsonl")
    logged = {s["doc_id"]: s for s in _jsonl(out / "samples" / "leaderboard_mmlu_pro.jsonl")}
    assert len(logged) == len(test_rows)
    right = 0
    for i, row in enumerate(test_rows):
        lls = logged[i]["eager"]["logliks"]
        assert len(lls) == len(row["options"])
        right += int(max(range(len(lls)), key=lls.__getitem__) == row["answer_index"])
    acc = rows[("leaderboard_mmlu_pro", "none")]["metrics"]["acc"]
    assert acc["eager"] == pytest.approx(right / len(test_rows))
    p = acc["paired"]
    assert p["both_right"] == right and p["both_wrong"] == len(test_rows) - right


@slow
def test_real_patch_agrees_and_leaves_model_as_it_was(tiny_dir, tmp_path, monkeypatch, capfd):
    """Also: the float64 reference run (auto for a float32 model) is the noise floor of the
    verdict, and lm-eval's git lookup prints nothing outside a repository."""
    model, tok = build_tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.chdir(tmp_path)  # not a git repository
    config = EvalConfig(output_dir=tmp_path / "out", load=LoadOptions(backend="torch"), print_summary=False,
                        tasks=TaskOptions(names=("gpqa_diamond_zeroshot",), local_data=(GPQA,), batch_size=4))
    report = run_eval(model, config, tokenizer=tok)
    assert "fatal: not a git repository" not in capfd.readouterr().err
    assert "patched 2 MLP" in report["patch_report"]
    row = _rows(report)[("gpqa_diamond_zeroshot", "none")]
    assert row["answers"]["answers_same"] == row["n"] == 24
    assert row["answers"]["max_abs_loglik_diff"] < 1e-4  # fp32: rounding at most
    assert row["answers"]["reference_answers_same"] == 24 and "reference_s" in report["timing"]
    assert [c["check"] for c in row["checks"]["checks"]] == ["accuracy", "accuracy", "answers", "logliks"]  # acc, acc_norm
    assert row["verdict"]["label"] == "no detectable difference"
    assert json.loads((tmp_path / "out" / "lm_eval_reference.json").read_text())["git_hash"] is not None
    assert not is_patched(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@slow
def test_perturbed_mlp_is_detected(identity_report, tiny_dir, tmp_path):
    """Answer key := the eager model's own choices, so eager scores 100%; a broken MLP must
    then lose a significant number of questions, and the token check must flag it."""
    _, out = identity_report
    chosen = {s["doc_id"]: s["eager"]["answer"] for s in _jsonl(out / "samples" / "leaderboard_mmlu_pro.jsonl")}
    data = tmp_path / "relabelled"
    data.mkdir()
    rows = _jsonl(FIXTURES / "mmlu_pro_test.jsonl")
    with open(data / "test.jsonl", "w") as fh:
        for i, r in enumerate(rows):
            fh.write(json.dumps({**r, "answer_index": chosen[i], "answer": "ABCDEFGHIJ"[chosen[i]]}) + "\n")
    (data / "validation.jsonl").write_text((FIXTURES / "mmlu_pro_validation.jsonl").read_text())
    config = EvalConfig(
        output_dir=tmp_path / "out", load=CPU32, print_summary=False,
        tasks=TaskOptions(names=("leaderboard_mmlu_pro",), local_data=(f"leaderboard_mmlu_pro={data}",), batch_size=4),
        text=TextOptions(path=str(FIXTURES / "generate.py"), window=64, max_tokens=512),
    )
    report = run_eval(str(tiny_dir), config, patcher=NoisyPatcher(scale=10.0))
    row = _rows(report)[("leaderboard_mmlu_pro", "none")]
    acc = row["metrics"]["acc"]
    assert acc["eager"] == 1.0
    assert acc["paired"]["right_to_wrong"] >= 10 and acc["paired"]["wrong_to_right"] == 0
    assert acc["paired"]["mcnemar_p"] < 0.05
    assert row["verdict"]["label"] == "DIFFERENCE" and "answers" in row["verdict"]["flagged"]
    assert row["answers"]["answers_same"] < row["n"]
    assert report["tokens"]["verdict"]["label"] == "DIFFERENCE"
    assert report["tokens"]["top1_agreement"] < 0.99


@slow
def test_generative_mmlu_pro_group_is_paired_per_category(tiny_dir, tmp_path):
    config = EvalConfig(
        output_dir=tmp_path, load=CPU32, print_summary=False,
        tasks=TaskOptions(names=("mmlu_pro",), local_data=(f"mmlu_pro={FIXTURES}",), limit=1, num_fewshot=1,
                          gen_kwargs="max_gen_toks=8", batch_size=4),
    )
    report = run_eval(str(tiny_dir), config, patcher=IdentityPatcher())
    leaves = [r for r in report["rows"] if r["kind"] == "task"]
    pooled = [r for r in report["rows"] if r["kind"] == "group"]
    assert len(leaves) == 14 and all(r["n"] == 1 for r in leaves)
    assert len(pooled) == 1 and pooled[0]["n"] == 14 and len(pooled[0]["subtasks"]) == 14
    assert pooled[0]["filter"] == "custom-extract" and pooled[0]["output_type"] == "generate_until"
    assert pooled[0]["answers"]["identical_text"] == 14 and pooled[0]["answers"]["answers_same"] == 14
    assert "exact_match" in pooled[0]["metrics"] and pooled[0]["metrics"]["exact_match"]["paired"]["n"] == 14


def _tasks_only(out, names, local=()):
    return EvalConfig(output_dir=out, tasks=TaskOptions(names=names, local_data=local))


def test_unknown_task_fails_before_the_model_loads(tiny_dir, tmp_path):
    """The model exists (so its source check passes); the task name is what fails, and no
    output folder is left behind."""
    out = tmp_path / "out"
    with pytest.raises(EvalSetupError, match="unknown lm-eval task.*leaderboard_mmlu_prox.*did you mean"):
        run_eval(str(tiny_dir), _tasks_only(out, ("leaderboard_mmlu_prox",)))
    assert not out.exists()


@pytest.mark.parametrize(
    "local, match",
    [
        (["leaderboard_mmlu_pro=/no/such/folder"], "does not exist"),
        ([f"leaderboard_mmlu_pro={FIXTURES / 'gpqa_synthetic.csv'}"], "lacks"),
        ([f"gpqa_diamond_zeroshot={FIXTURES / 'gpqa_synthetic.csv'}"], "not among the requested tasks"),
        (["leaderboard_mmlu_pro"], "expects TASK=PATH"),
    ],
)
def test_bad_local_data_fails_before_the_model_loads(tiny_dir, tmp_path, local, match):
    out = tmp_path / "out"
    with pytest.raises(EvalSetupError, match=match):
        run_eval(str(tiny_dir), _tasks_only(out, ("leaderboard_mmlu_pro",), tuple(local)))
    assert not out.exists()


def test_tasks_on_an_unreachable_hub_fail_at_once_with_the_fix(tmp_path, monkeypatch):
    """gpqa reads the hub, mmlu_pro local files: only gpqa is named, before any dataset is built."""
    from swiglu_patch.evals.harness import prepare_tasks
    from swiglu_patch.evals.local_tasks import task_manager

    task_manager()  # lm-eval's task index (seconds, built once per process) is not what is timed
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    t0 = time.perf_counter()
    with pytest.raises(EvalSetupError) as info:
        prepare_tasks(["leaderboard_mmlu_pro", "gpqa_diamond_zeroshot"], [MMLU_PRO], tmp_path)
    assert time.perf_counter() - t0 < 15  # datasets' retries take ~24 s per file
    msg = str(info.value)
    assert "gpqa_diamond_zeroshot" in msg and "leaderboard_mmlu_pro" not in msg
    assert "does not answer" in msg and "--local-data" in msg and "HF_HUB_OFFLINE=1" in msg


def test_unpatchable_model_fails_before_any_evaluation(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from swiglu_patch.cli import main

    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=259)).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["eval", "--model", str(path), "--text", str(FIXTURES / "generate.py"), "--window", "64",
                 "--output-dir", str(out), "--device", "cpu"])
    assert code == 2
    errors = [line for line in capsys.readouterr().err.split("\n") if "error" in line]  # not transformers' load bar
    assert len(errors) == 1 and errors[0].startswith("swiglu-patch eval: error:"), errors
    assert "cannot be patched" in errors[0] and "nothing was evaluated" in errors[0]
    assert not out.exists()


@slow
def test_lm_eval_cli_runs_the_registered_fused_model_type(tiny_dir, identity_report):
    _, out = identity_report
    from lm_eval.api.registry import get_model

    from swiglu_patch.evals.lm_model import FusedMLPLM

    assert get_model("hf-fused-mlp") is FusedMLPLM
    cmd = [sys.executable, "-m", "swiglu_patch.evals.lm_eval_main", "run", "--model", "hf-fused-mlp",
           "--model_args", f"pretrained={tiny_dir},dtype=float32,fused_backend=torch", "--tasks", "gpqa_diamond_zeroshot",
           "--include_path", str(out / "lm_eval_tasks"), "--limit", "4", "--device", "cpu", "--batch_size", "4"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "hf-fused-mlp" in res.stdout and "gpqa_diamond_zeroshot" in res.stdout
    assert "patched 2 MLP" in res.stderr
