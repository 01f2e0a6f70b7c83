"""Token-level agreement: checked against a direct full-logit computation and HF's own loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import NoisyPatcher, build_tiny_llama

from swiglu_patch import is_patched
from swiglu_patch.evals.errors import EvalSetupError
from swiglu_patch.evals.patching import IdentityPatcher, Patcher
from swiglu_patch.evals.report import token_verdict
from swiglu_patch.evals.token_agreement import _cast_floating, compare_tokens, make_windows, special_prefix

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. "
) * 3


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_llama(seed=3)


def test_windows_start_with_the_tokenizers_prefix(tiny):
    _, tok = tiny
    assert special_prefix(tok) == [tok.bos_token_id]
    w = make_windows(tok, TEXT, window=64)
    body = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert w.shape == (len(body) // 63, 64)
    assert (w[:, 0] == tok.bos_token_id).all()
    assert w[1, 1:].tolist() == body[63:126]
    assert make_windows(tok, TEXT, window=64, max_tokens=128).shape == (2, 64)
    with pytest.raises(EvalSetupError, match="fewer than one window"):
        make_windows(tok, "short", window=64)


def test_identity_is_identical(tiny, capsys):
    model, tok = tiny
    windows = make_windows(tok, TEXT, 64)
    out = compare_tokens(model, windows, patcher=IdentityPatcher(), batch_size=2)
    assert out["kl_mean"] == 0.0 and out["max_abs_logit_diff"] == 0.0 and out["top1_agreement"] == 1.0
    assert token_verdict(out)["label"] == "identical"
    n = 2 * windows.shape[0]  # the progress bar counts each window through the eager and the fused run
    last = capsys.readouterr().err.split("\r")[-1]
    assert "token-level (eager, fused)" in last and f"{n}/{n}" in last, last
    compare_tokens(model, windows, patcher=IdentityPatcher(), batch_size=2, progress=False)
    assert "token-level" not in capsys.readouterr().err


def test_statistics_match_a_direct_computation(tiny):
    model, tok = tiny
    windows = make_windows(tok, TEXT, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patcher = NoisyPatcher(scale=0.5, seed=1)
    out = compare_tokens(model, windows, patcher=patcher, batch_size=3, chunk_positions=50)
    assert not is_patched(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    with torch.no_grad():
        e = model(input_ids=windows).logits.double()
        eager_loss = model(input_ids=windows, labels=windows).loss.item()
        patcher.apply(model)
        f = model(input_ids=windows).logits.double()
        fused_loss = model(input_ids=windows, labels=windows).loss.item()
        patcher.restore(model)
    kl = F.kl_div(F.log_softmax(f, -1), F.log_softmax(e, -1), log_target=True, reduction="none").sum(-1)
    assert out["positions"] == windows.numel()
    assert out["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert out["kl_max"] == pytest.approx(kl.max().item(), rel=1e-4)
    assert out["top1_agreement"] == pytest.approx((e.argmax(-1) == f.argmax(-1)).double().mean().item())
    assert out["max_abs_logit_diff"] == pytest.approx((e - f).abs().max().item(), rel=1e-5)
    # HF's loss is the mean NLL of tokens 1..L-1 per window; equal-length windows -> same mean
    assert out["ppl_eager"] == pytest.approx(math.exp(eager_loss), rel=1e-5)
    assert out["ppl_fused"] == pytest.approx(math.exp(fused_loss), rel=1e-5)
    assert out["kl_mean"] > 1e-4  # the noise did something


def test_memory_groups_do_not_change_the_result(tiny):
    model, tok = tiny
    windows = make_windows(tok, TEXT, 64)
    one = compare_tokens(model, windows, patcher=NoisyPatcher(0.5, seed=1), batch_size=1)
    many_patcher = NoisyPatcher(0.5, seed=1)
    many = compare_tokens(model, windows, patcher=many_patcher, batch_size=1, max_stored_bytes=1)
    assert many_patcher.applied == windows.shape[0]  # one window per group: patched that often
    for k in ("kl_mean", "kl_max", "top1_agreement", "max_abs_logit_diff", "ppl_eager", "ppl_fused"):
        assert many[k] == pytest.approx(one[k], rel=1e-9), k


def test_reference_run_in_float32_for_a_bf16_model(tiny):
    model, tok = build_tiny_llama(seed=3)
    model = model.to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = make_windows(tok, TEXT, 64)
    out = compare_tokens(model, windows, patcher=Patcher(backend="torch"), batch_size=2, reference_dtype=torch.float32)
    assert all(v.dtype == before[k].dtype and torch.equal(before[k], v) for k, v in model.state_dict().items())
    ref = out["reference"]
    assert ref["dtype"] == "float32"
    # eager bf16 vs the float32 model: not identical, and the same reference for both sides
    assert ref["eager"]["kl_mean"] > 0 and ref["eager"]["ppl_reference"] == pytest.approx(ref["fused"]["ppl_reference"])
    assert ref["eager"]["ppl_eager"] == pytest.approx(out["ppl_eager"])
    v = token_verdict(out)
    assert v["label"] == "agrees", v["line"]
    broken = compare_tokens(model, windows, patcher=NoisyPatcher(2.0, seed=1), batch_size=2, reference_dtype=torch.float32)
    assert token_verdict(broken)["label"] == "DIFFERENCE"


def test_cast_floating_round_trip_is_exact_with_tied_weights():
    model, _ = build_tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    model = model.to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old = _cast_floating(model, torch.float32)
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    _cast_floating(model, old)
    assert all(v.dtype == torch.bfloat16 and torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_load_text_from_file_and_local_dataset(tmp_path):
    from swiglu_patch.evals.token_agreement import load_text

    f = tmp_path / "a.txt"
    f.write_text("hello world")
    assert load_text(path=str(f)) == "hello world"
    pytest.importorskip("datasets", reason="a dataset column needs `datasets` (the [eval] extra installs it)")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "first"}\n{"text": ""}\n{"text": "second"}\n')
    assert load_text(dataset=str(rows)) == "first\n\nsecond"
    with pytest.raises(EvalSetupError, match="no column 'body'"):
        load_text(dataset=str(rows), column="body")
    with pytest.raises(EvalSetupError, match="exactly one"):
        load_text()
    with pytest.raises(EvalSetupError, match="no such file"):
        load_text(path=str(tmp_path / "missing.txt"))
