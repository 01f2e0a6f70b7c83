"""CPU tests of the benchmarks' shared harness (benchmarks/harness/): shape and model tables,
floor arithmetic, timers, host-time turns, the accuracy check, command-line plumbing."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.harness import cli, host_time, ways
from benchmarks.harness.accuracy import REL_ERR_BOUNDS, Reference, activation_f64, check_rows, rel_error
from benchmarks.harness.models import MODELS, TINY, build_model, mlps
from benchmarks.harness.roofline import Peaks, floor_seconds, gated_flops, measure_peaks, min_bytes
from benchmarks.harness.shapes import SHAPES, TOKENS, select_shapes
from benchmarks.harness.timing import CpuTimer, EventTimer, GraphTimer, gpu_timer


# ---------------------------------------------------------------- shape table


def test_shape_table_holds_the_issue_models():
    # (K, I, activation) from each model's config.json, as issue 3 lists them.
    want = {
        (2048, 8192, "silu"),  # Llama-3.2-1B
        (4096, 14336, "silu"),  # Llama-3-8B / Mistral-7B
        (3584, 18944, "silu"),  # Qwen2.5-7B
        (3584, 14336, "gelu_tanh"),  # Gemma-2-9B
        (4608, 36864, "gelu_tanh"),  # Gemma-2-27B
        (8192, 28672, "silu"),  # Llama-3-70B
    }
    got = {(s.hidden, s.intermediate, s.activation) for s in SHAPES}
    assert got == want
    assert len({s.name for s in SHAPES}) == len(SHAPES)


def test_tp_shards_are_whole_packing_blocks_of_table_models():
    from benchmarks.harness.shapes import TP_SHARD_SHAPES

    full = {(s.hidden, s.activation): s.intermediate for s in SHAPES}
    for s in TP_SHARD_SHAPES:
        tp = int(s.name.rsplit("-tp", 1)[1])
        assert full[(s.hidden, s.activation)] == s.intermediate * tp  # I / tp of a table model
        assert s.intermediate % 16 == 0  # a column shard never splits a gate/up block


def test_shape_activations_are_the_kernels():
    from swiglu_patch.kernels.epilogue import ACTIVATIONS

    assert {s.activation for s in SHAPES} <= set(ACTIVATIONS)
    assert set(ways.HF_ACT_NAMES) == set(ACTIVATIONS)


def test_tokens_are_powers_of_two_1_to_16384():
    assert list(TOKENS) == [2**e for e in range(15)]


def test_select_shapes_keeps_table_order_and_rejects_unknown():
    names = [SHAPES[3].name, SHAPES[0].name]
    assert [s.name for s in select_shapes(names)] == [SHAPES[0].name, SHAPES[3].name]
    with pytest.raises(ValueError, match="unknown shape.*known"):
        select_shapes(["llama-9000"])


# ---------------------------------------------------------------- floor arithmetic


def test_flops_and_bytes_llama3_8b_decode_by_hand():
    # M=1, K=4096, I=14336, bf16: weight 2*14336*4096 = 117,440,512 elements = 234,881,024 bytes,
    # plus x (4096) and out (14336) elements = 36,864 bytes.
    assert min_bytes(1, 4096, 14336, 2) == 234_917_888
    assert gated_flops(1, 4096, 14336) == 2 * 28672 * 4096
    # At 3 TB/s that is 78.3 us (the H100 bench table's floor for this row: 77.6 us at its measured 3.03 TB/s).
    peaks = Peaks(matmul_tflops=700.0, copy_tbps=3.0, matmul_n=8192, copy_mib=1024)
    assert floor_seconds(gated_flops(1, 4096, 14336), 234_917_888, peaks) == pytest.approx(78.306e-6, rel=1e-4)


def test_floor_is_the_larger_bound():
    peaks = Peaks(matmul_tflops=1000.0, copy_tbps=2.0, matmul_n=1, copy_mib=1)
    # 1e12 flops at 1e15/s = 1 ms; 1e9 bytes at 2e12/s = 0.5 ms -> compute bound.
    assert floor_seconds(1e12, 1e9, peaks) == pytest.approx(1e-3)
    # 1e10 bytes = 5 ms -> memory bound.
    assert floor_seconds(1e12, 1e10, peaks) == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="positive"):
        floor_seconds(1.0, 1.0, Peaks(0.0, 1.0, 1, 1))


def test_measure_peaks_arithmetic_with_a_fixed_timer():
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 2e-3  # every call "takes" 2 ms

    p = measure_peaks(torch.device("cpu"), torch.float32, timer, matmul_n=64, copy_bytes=1 << 20)
    assert len(calls) == 2
    assert p.matmul_tflops == pytest.approx(2 * 64**3 / 2e-3 / 1e12)
    assert p.copy_tbps == pytest.approx(2 * (1 << 20) / 2e-3 / 1e12)  # read + written


# ---------------------------------------------------------------- timers


def test_gpu_timer_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown timer 'wallclock'; known: graph, do_bench"):
        gpu_timer("wallclock", 10, 40)


def test_cpu_timer_many_times_each_callable():
    calls = {"a": 0, "b": 0}

    def bump(key):
        calls[key] += 1

    out = CpuTimer(reps=3).many({"a": lambda: bump("a"), "b": lambda: bump("b")})
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert calls == {"a": 4, "b": 4}  # one warm-up + 3 timed each


@pytest.mark.gpu
def test_graph_timer_without_a_flush_says_so_and_a_bad_flush_names_the_choices():
    timer = GraphTimer(warmup_ms=200, rep_ms=400, rounds=3, flush="none")  # no flush buffer: builds on a CPU too
    assert "no L2 flush, replays back to back" in timer.describe() and "400 ms of timed calls" in timer.describe()
    timer._flush()  # nothing to do
    with pytest.raises(ValueError, match="read, zero, none"):
        GraphTimer(flush="evict")


def test_event_timer_reverses_the_order_every_other_round():
    calls = []
    out = EventTimer(cuda=False, reps=2, rounds=3, warmup=0).many({"a": lambda: calls.append("a"),
                                                                   "b": lambda: calls.append("b")})
    assert calls == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"] and set(out) == {"a", "b"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GraphTimer captures CUDA graphs: needs a GPU")
def test_graph_timer_captures_and_falls_back_for_a_host_sync():
    timer = GraphTimer(warmup_ms=1, rep_ms=5, rounds=2)
    a = torch.randn(2048, 2048, device="cuda")
    t = timer.many({"mm": lambda: a @ a, "sync": lambda: (a @ a).sum().item()})
    assert timer.modes["mm"] == "graph" and timer.modes["sync"].startswith("eager (host sync")
    # a 2048^3 fp32 matmul: 17 GFLOP, between 10 us and 10 ms on any GPU this runs on
    assert 1e-5 < t["mm"] < 1e-2 and t["sync"] > 0
    torch.randn(4, device="cuda")  # the process's CUDA generator still works: no capture was tried


# ---------------------------------------------------------------- accuracy check


@pytest.mark.parametrize("activation,torch_fn", [
    ("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh")), ("gelu", F.gelu)])
def test_activation_formulas_match_torch(activation, torch_fn):
    g = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    torch.testing.assert_close(activation_f64(g, activation), torch_fn(g), rtol=1e-12, atol=1e-12)


def test_check_rows_first_last_unique():
    rows = check_rows(1000, 8, torch.Generator().manual_seed(0))
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 8 and len(set(rows.tolist())) == 8
    assert check_rows(3, 8).tolist() == [0, 1, 2]


def test_rel_error_separates_right_from_wrong():
    torch.manual_seed(0)
    k, i = 64, 48
    gate, up = torch.randn(i, k) / k**0.5, torch.randn(i, k) / k**0.5
    x = torch.randn(5, k)
    ref = Reference(gate, up, "silu")
    bf16 = (F.silu(x.bfloat16() @ gate.bfloat16().T) * (x.bfloat16() @ up.bfloat16().T))
    swapped = F.silu(x @ up.T) * (x @ gate.T)  # gate and up confused: a layout bug
    bound = REL_ERR_BOUNDS[torch.bfloat16]
    assert rel_error(bf16, ref.gated(x)) < bound / 2
    assert rel_error(swapped, ref.gated(x)) > 10 * bound
    assert rel_error(bf16[:, :-1], ref.gated(x)) == math.inf  # wrong shape
    assert ref.preact(x).shape == (5, 2 * i)




# ---------------------------------------------------------------- models


def test_model_table_takes_its_mlp_dimensions_from_the_shape_table():
    shapes = {s.name: s for s in SHAPES}
    for name, dims in MODELS.items():
        assert (dims.hidden, dims.intermediate) == (shapes[name].hidden, shapes[name].intermediate)
        assert dims.heads % dims.kv_heads == 0 and dims.hidden % dims.heads == 0
    assert (MODELS["llama-3-8b"].heads, MODELS["llama-3-8b"].vocab) == (32, 128256)  # config.json
    assert (MODELS["qwen2.5-7b"].heads, MODELS["qwen2.5-7b"].kv_heads, MODELS["qwen2.5-7b"].vocab) == (28, 4, 152064)
    assert set(TINY) == set(MODELS)


@pytest.mark.parametrize("name", sorted(TINY))
def test_build_model_is_seeded_and_frozen(name):
    a = build_model(TINY[name], 1, "cpu", torch.float32, seed=3)
    b = build_model(TINY[name], 1, "cpu", torch.float32, seed=3)
    assert a.config.model_type == TINY[name].model_type and len(mlps(a)) == 1
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not any(p.requires_grad for p in a.parameters()) and not a.training


# ---------------------------------------------------------------- host time and turns


def test_host_from_idle_times_every_call_in_turns():
    order = []
    samples = host_time.host_from_idle({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                       calls=6, rounds=3, sync=lambda: None, warmup=1)
    assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 6}
    timed = order[2:]  # after one warm-up call each
    assert timed == ["a"] * 2 + ["b"] * 2 + ["b"] * 2 + ["a"] * 2 + ["a"] * 2 + ["b"] * 2  # reversed every other round


def test_in_turns_and_ratio_stats():
    order = []
    times = host_time.in_turns({"eager": lambda: order.append("e"), "patched": lambda: order.append("p")}, 4,
                               lambda: None)
    assert order == ["e", "p", "p", "e", "e", "p", "p", "e"] and all(len(t) == 4 for t in times.values())
    r = host_time.ratio_stats([2.0, 3.0, 4.0], [1.0, 2.0, 4.0])
    assert r["rounds"] == [2.0, 1.5, 1.0] and (r["median"], r["min"], r["max"]) == (1.5, 1.0, 2.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        host_time.ratio_stats([1.0], [])


def test_us_stats_by_hand():
    s = host_time.us_stats([i * 1e-6 for i in range(1, 12)])  # 1..11 µs
    assert s["median_us"] == pytest.approx(6.0) and s["p10_us"] == pytest.approx(2.0)
    assert s["p90_us"] == pytest.approx(10.0) and s["calls"] == 11


# ---------------------------------------------------------------- command-line plumbing


def test_parser_errors_are_one_line_with_exit_code_2(capsys):
    p = cli.Parser(prog="prog")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prog: error: argument --n")


def test_guarded_turns_usage_errors_into_one_line(capsys):
    def fails(argv):
        raise cli.UsageError("bad thing; do this instead")

    with pytest.raises(SystemExit) as e:
        cli.guarded("prog", fails, [])
    assert e.value.code == 2 and capsys.readouterr().err == "prog: error: bad thing; do this instead\n"


def test_read_json_names_the_file(tmp_path):
    with pytest.raises(cli.UsageError, match="missing.json: no such file"):
        cli.read_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(cli.UsageError, match="bad.json: not a results JSON"):
        cli.read_json(tmp_path / "bad.json")


def test_write_json_keeps_it_standard(tmp_path):
    path = cli.write_json({"a": [math.inf, 1.0, math.nan], "b": {"c": -math.inf}}, tmp_path / "x" / "r.json")
    assert json.loads(path.read_text()) == {"a": [None, 1.0, None], "b": {"c": None}}
