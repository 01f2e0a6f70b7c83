"""The upcycling recipe (swiglu_patch.evals.upcycle) on a tiny random Gemma 3, and the routing record.

A 2-layer Gemma 3 (sliding then full attention, random norm weights so that every 1 + w matters)
becomes a Gemma 4 MoE text model: the shapes the recipe promises, the fused experts path taking
it, the dense model's logits back with zero noise, routing that moves the output, and the
routing flips counted exactly where a known change of the router moves them.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM

from swiglu_patch import apply_fused_mlp, unpatch
from swiglu_patch.evals.defects import DefectPatcher
from swiglu_patch.evals.moe_verdict import final_hidden, full_vocab_nll, measure_moe
from swiglu_patch.evals.patching import Patcher
from swiglu_patch.evals.routing import RoutingRecorder, routing_flips
from swiglu_patch.evals.power import FIXTURE
from swiglu_patch.evals.upcycle import Recipe, host_config, main, to_markdown, upcycle

ROOT = Path(__file__).resolve().parents[2]

V, H, I, E, K = 96, 64, 80, 4, 2


def _dense(layer_types=("sliding_attention", "full_attention")) -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=len(layer_types), num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=64, sliding_window=8, layer_types=list(layer_types),
        hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "mlp" in name:
                p.normal_(0.0, 0.1)  # feed-forward outputs of the size of the residual, as in a trained model
    return model


def _ids(rows: int, length: int = 24, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(3, V, (rows, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 2  # <bos>
    return ids


def _moe(dense, **recipe) -> Gemma4ForCausalLM:
    model = upcycle(dense, Recipe(experts=E, top_k=K, **recipe), _ids(4, seed=7))
    model.config._attn_implementation = "eager"
    return model


@torch.no_grad()
def test_recipe_shapes_and_the_fused_experts_path():
    dense = _dense()
    moe = _moe(dense, noise=0.1)
    assert isinstance(moe, Gemma4ForCausalLM) and moe.config.model_type == "gemma4_text"
    assert moe.config.enable_moe_block and moe.config.num_experts == E and moe.config.top_k_experts == K
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    for layer in moe.model.layers:
        assert layer.experts.gate_up_proj.shape == (E, 2 * I, H) and layer.experts.down_proj.shape == (E, H, I)
        assert layer.router.proj.weight.shape == (E, H) and layer.mlp.gate_proj.weight.shape == (I, H)
        # the experts are distinct perturbations of the dense MLP: [gate; up] halves, 0.1 std(W) apart
        gate = layer.mlp.gate_proj.weight
        for e in range(E):
            d = layer.experts.gate_up_proj[e, :I] - gate
            assert 0.07 < (d.std() / gate.std()).item() < 0.13
    ids = _ids(3)
    eager = moe(ids).logits
    report = apply_fused_mlp(moe, backend="torch")
    try:
        assert sorted(report.experts) == ["model.layers.0.experts", "model.layers.1.experts"]
        assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(report.patched)
        fused = moe(ids).logits
    finally:
        unpatch(moe)
    assert (fused - eager).abs().max() <= 1e-4 * eager.abs().max()
    assert torch.equal(moe(ids).logits, eager)


@torch.no_grad()
def test_zero_noise_gives_the_dense_model_and_noise_moves_it():
    dense = _dense()
    ids = _ids(3)
    want = dense(ids).logits
    exact = _moe(dense, noise=0.0)(ids).logits
    # float32 rounding of the rescaled weights (o_proj, down) only: 1e-5 of the largest logit;
    # a recipe error (1 + w, the attention scaling, v_norm, the branch mix) moves it by 1e-2 or more
    assert (exact - want).abs().max() <= 1e-5 * want.abs().max()
    moved = _moe(dense, noise=0.1)(ids).logits
    assert (moved - want).abs().max() > 1e-3 * want.abs().max()


@torch.no_grad()
def test_routing_changes_the_output_and_spreads_over_the_experts():
    moe = _moe(_dense(), noise=0.1)
    ids = _ids(4, seed=7)  # the calibration text
    with RoutingRecorder(moe) as routes:
        base = moe(ids).logits
    chosen = torch.cat(routes.calls).long()
    assert set(chosen.flatten().tolist()) == set(range(E))  # every expert picked
    assert len({tuple(sorted(r)) for r in chosen.tolist()}) >= 4  # top-k sets vary from token to token
    layer = moe.model.layers[0].router.proj.weight
    layer.copy_(layer.roll(1, 0))  # other experts for every token, the same spread
    assert (moe(ids).logits - base).abs().max() > 1e-3 * base.abs().max()


@torch.no_grad()
def test_routing_flips_counted_where_the_router_moves_them():
    moe = _moe(_dense(), noise=0.1)
    ids = _ids(3)
    with RoutingRecorder(moe) as before:
        moe(ids)
    proj = moe.model.layers[1].router.proj.weight  # the last layer: nothing downstream routes
    proj[[0, 1]] = proj[[1, 0]].clone()
    with RoutingRecorder(moe) as after:
        moe(ids)
    assert len(before.calls) == len(after.calls) == 2
    assert torch.equal(before.calls[0], after.calls[0])
    swap = torch.tensor([1, 0, *range(2, E)])
    assert torch.equal(after.calls[1].long(), swap[before.calls[1].long()])
    last = before.calls[1].long()
    one_of = ((last == 0) | (last == 1)).sum(-1) == 1  # the set changes iff it holds exactly one of the two
    flips = routing_flips(before.calls, after.calls)
    assert flips["decisions"] == 2 * ids.numel()
    assert flips["set_changed"] == pytest.approx(one_of.sum().item() / flips["decisions"])
    assert flips["top1_changed"] == pytest.approx(((last[:, 0] == 0) | (last[:, 0] == 1)).sum().item()
                                                  / flips["decisions"])
    assert routing_flips(before.calls, before.calls)["set_changed"] == 0.0
    with pytest.raises(ValueError, match="same inputs"):
        routing_flips(before.calls, after.calls[:1])


def test_measure_moe_clean_agrees_and_a_broken_mlp_flips_routes():
    moe = _moe(_dense(), noise=0.1)
    moe.set_experts_implementation("eager")  # the float64 reference: torch's grouped_mm takes no float64
    prompts = [p for p in _ids(6, length=12, seed=3)]
    windows = _ids(2, length=32, seed=4)
    args = (moe, prompts, [10, 11, 12, 13], [0, 1, 2, 3, 0, 1], windows)
    clean = measure_moe(*args, Patcher(backend="torch"), reference_dtype=torch.float64)
    assert clean["tokens"]["label"] in ("identical", "agrees")
    assert clean["routing"]["eager_vs_fused"]["decisions"] == 2 * (6 * 12 + 2 * 32)
    assert clean["routing"]["eager_vs_fused"]["set_changed"] == 0.0
    table = to_markdown({"setup": "tiny", "model_check_max_abs_logit_diff": {"dense": 0.0, "upcycled, zero noise": 0.0},
                         "verdict": clean})
    assert "| same answer, 6 questions |" in table and "top-k set, 272 (token, layer) | 0.00% | 0.00% |" in table
    broken = measure_moe(*args, DefectPatcher("swap_gate_up"), reference_dtype=torch.float64)
    assert broken["tokens"]["label"] == "DIFFERENCE"
    # layer 1's router sees layer 0's broken MLP: 7% of all decisions move (15% of layer 1's)
    assert broken["routing"]["eager_vs_fused"]["set_changed"] > 0.02
    assert broken["routing"]["eager_vs_reference"]["set_changed"] <= 0.01
    assert "| DIFFERENCE |" in to_markdown({**{"setup": "", "model_check_max_abs_logit_diff": {
        "dense": 0.0, "upcycled, zero noise": 0.0}}, "verdict": broken})


@torch.no_grad()
def test_full_vocab_nll_is_the_models_own_loss():
    dense = _dense()
    ids = _ids(2)
    logits = dense(ids).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).double(), ids[:, 1:].reshape(-1))
    other = _dense()
    hidden = {"d": final_hidden(dense, ids), "o": final_hidden(other, ids)}
    got = full_vocab_nll(hidden, ids, dense.model.embed_tokens.weight, ("d",))
    assert got["d"]["nll"] == pytest.approx(want.item(), rel=1e-5) and got["d"]["kl_from"] == {"d": 0.0}
    p, q = (torch.log_softmax((h[:, :-1] @ dense.model.embed_tokens.weight.T).double(), -1) for h in hidden.values())
    assert got["o"]["kl_from"]["d"] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-9)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="top_k"):
        Recipe(experts=4, top_k=5)
    with pytest.raises(ValueError, match="share"):
        Recipe(share=1.0)
    with pytest.raises(ValueError, match="last layer"):
        host_config(_dense(("full_attention", "sliding_attention")).config, Recipe())
    with pytest.raises(TypeError, match="Gemma 3"):
        upcycle(_moe(_dense()), Recipe(), _ids(1))


@pytest.mark.parametrize("argv, message", [
    (["--share", "1.5"], "share must be in (0, 1)"),
    (["--slice", "MISSING"], "no slice.json"),
    (["--text-windows", "20", "--calibration-windows", "20"], "need 10200 text tokens"),
])
def test_command_line_refusals_are_one_line(tmp_path, capsys, argv, message):
    argv = [a.replace("MISSING", str(tmp_path / "missing")) for a in argv]
    rc = main(["--out", str(tmp_path / "out"), "--fixture", str(ROOT / FIXTURE), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.real_model
def test_command_line_on_the_real_model_slice(gemma3_slice, planted_data, tmp_path):
    """The GPU command's path on a CPU: the real Gemma 3 270M from gguf_slice's pieces, upcycled (2
    experts, top-1, to keep it short), verdicts and routing flips written."""
    data = planted_data
    rc = main(["--out", str(tmp_path / "out"), "--fixture", str(ROOT / FIXTURE), "--slice", str(gemma3_slice),
               "--backend", "torch", "--questions", "2", "--text-windows", "1", "--calibration-windows", "1",
               "--window", "64", "--experts", "2", "--top-k", "1", "--threads", "2"])
    assert rc == 0
    out = json.loads((tmp_path / "out" / "upcycle.json").read_text())
    r = out["verdict"]
    assert "perplexity" not in out and r["n"] == 2
    tokens = 64 + sum(len(q["prompt_ids"]) for q in data["questions"][:2])
    assert r["routing"]["eager_vs_fused"]["decisions"] == 18 * tokens  # every token, every layer
    assert r["tokens"]["label"] in ("identical", "agrees", "DIFFERENCE") and "routing decisions" in (
        tmp_path / "out" / "upcycle.md").read_text()


def test_harness_command_line_refuses_a_missing_text(tmp_path, capsys):
    from swiglu_patch.evals.upcycle_harness import main as harness

    rc = harness(["--out", str(tmp_path / "out"), "--fixture", str(ROOT / FIXTURE), "--text", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and "none.txt: no such file" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
