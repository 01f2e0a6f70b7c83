"""The verdict functions on hand-made per-question and per-token numbers, and the paired bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swiglu_patch.evals.stats import binom_tail, least_flagged, mdd_paired, mdd_unpaired, too_few_questions
from swiglu_patch.evals.verdicts import (
    answer_check,
    clamp_kl,
    kl_stats,
    loglik_check,
    question_checks,
    token_check,
)


@pytest.mark.parametrize("k, n, p", [(0, 5, 0.3), (3, 10, 0.5), (7, 9, 0.6), (40, 60, 0.6), (12, 12, 0.6)])
def test_binom_tail_matches_scipy(k, n, p):
    stats = pytest.importorskip("scipy.stats")
    assert binom_tail(k, n, p) == pytest.approx(stats.binom.sf(k - 1, n, p), rel=1e-9)


def test_least_flagged_is_the_first_flagged_count():
    for c, p0, level in ((0, 0.6, 0.0167), (3, 0.6, 0.0167), (10, 0.5, 0.05)):
        b = least_flagged(c, p0, level, 1000)
        assert binom_tail(b, b + c, p0) < level <= binom_tail(b - 1, b - 1 + c, p0)
    assert least_flagged(0, 0.6, 0.0167, 3) is None  # 0.6^3 = 0.216: 3 questions cannot reach it


@pytest.mark.parametrize("n, p, discordant", [(400, 0.27, 380), (400, 0.27, 150), (50, 0.3, 40), (6000, 0.27, 90),
                                              (20, 0.5, 19)])
def test_paired_bound_never_worse_than_unpaired(n, p, discordant):
    """The issue's n = 400: a scattered fused run (discordance far above two independent runs')
    once gave 9.7 pts paired against 8.8 unpaired."""
    assert not too_few_questions(n, p)
    assert mdd_paired(discordant, n, p=p) <= mdd_unpaired(p, n) + 1e-12


def test_too_few_questions_instead_of_a_bound_over_100_points():
    assert too_few_questions(5, 0.3)  # 6 one-way flips are needed at alpha 0.05
    assert too_few_questions(10, 0.1)  # 6 / 10 > 2 * 0.1 * 0.9
    assert not too_few_questions(50, 0.3)
    from swiglu_patch.evals.pairing import paired_binary

    m = paired_binary([1, 0, 1, 0, 0], [1, 0, 1, 0, 0])
    assert m.too_few and m.mdd_paired is None


def test_answers_check_flags_scattered_answers_that_keep_accuracy():
    """The issue's case: near chance, 96% of answers changed, accuracy the same."""
    rng = np.random.default_rng(0)
    n = 50
    ref = rng.integers(0, 4, n).tolist()
    eager = list(ref)
    eager[0] = (eager[0] + 1) % 4  # eager departs from the reference once (bf16 rounding)
    fused = rng.integers(0, 4, n).tolist()
    key = rng.integers(0, 4, n).tolist()
    right = {"acc": ([float(a == k) for a, k in zip(eager, key)], [float(a == k) for a, k in zip(fused, key)])}
    v = question_checks(alpha=0.05, eager=eager, fused=fused, reference=ref, right=right)
    assert v["label"] == "DIFFERENCE" and v["flagged"] == ["answers"]
    clean = list(ref)
    clean[1] = (clean[1] + 1) % 4  # a correct fused path departs about as often as eager
    v = question_checks(alpha=0.05, eager=eager, fused=clean, reference=ref)
    assert v["label"] == "no detectable difference"
    c = answer_check(eager, clean, ref, 0.05)
    assert (c["fused_departs"], c["eager_departs"], c["eager_vs_reference"]) == (1, 1, 1)
    # b / (b + c) = 1 of 2 is within the allowed 1.25 / 2.25 = 0.556; with c = 1, b = 8 is the first flagged:
    # P[X >= 8 | 9, 0.556] = 0.042 < 0.05 <= P[X >= 7 | 8, 0.556] = 0.068
    assert c["detectable"] == least_flagged(1, 1.25 / 2.25, 0.05, n - 1) == 8


def test_answers_check_without_reference_uses_the_ceiling():
    eager = [0] * 100
    assert not answer_check(eager, [1] * 3 + [0] * 97, None, 0.05)["flagged"]
    assert answer_check(eager, [1] * 15 + [0] * 85, None, 0.05)["flagged"]


def test_loglik_check_is_a_sign_test_of_shifts():
    ref = [[-1.0, -2.0]] * 40
    eager = [[-1.0 + 0.01, -2.0 - 0.01]] * 40
    small = [[-1.0 - 0.012, -2.0]] * 40  # 1.2x eager's shift: within ratio 2
    big = [[-1.0 - 0.05, -2.0]] * 40  # 5x eager's
    assert not loglik_check(eager, small, ref, 0.05)["flagged"]
    c = loglik_check(eager, big, ref, 0.05)
    assert c["flagged"] and c["worse"] == 40 and c["p"] == pytest.approx(0.5**40)
    # half worse, half not: a coin
    mixed = big[:20] + small[:20]
    assert not loglik_check(eager, mixed, ref, 0.05)["flagged"]


def test_bonferroni_over_the_checks():
    v = question_checks(alpha=0.06, eager=[0, 1], fused=[0, 1], reference=[0, 1],
                        right={"acc": ([1, 0], [1, 0])}, logliks=([[-1.0]] * 2, [[-1.0]] * 2, [[-1.0]] * 2))
    assert v["level_each"] == pytest.approx(0.02) and len(v["checks"]) == 3


def test_kl_stats_and_rounding():
    s = kl_stats([0.0, 1.0, 2.0, 3.0, 4.0])
    assert (s["kl_mean"], s["kl_median"], s["kl_max"]) == (2.0, 2.0, 4.0)
    assert s["kl_p99"] == pytest.approx(np.quantile([0, 1, 2, 3, 4], 0.99))
    assert clamp_kl(-3.4e-9) == 0.0 and clamp_kl(-1e-3) == -1e-3 and clamp_kl(2e-9) == 2e-9


def _stats(mean, p99, mx, **kw):
    return {"kl_mean": mean, "kl_p99": p99, "kl_max": mx, "max_abs_logit_diff": 1.0, **kw}


def test_token_check_uses_the_mean_against_the_floor_and_the_tail():
    noise = _stats(1e-3, 1e-2, 5e-2)
    clean = token_check(_stats(1.7e-3, 2e-2, 1e-1), noise, _stats(1e-3, 1e-2, 5e-2))
    assert clean["label"] == "agrees" and clean["flagged"] == []
    mean = token_check(_stats(3e-3, 2e-2, 1e-1), noise, _stats(1.3e-3, 1e-2, 5e-2))
    assert mean["flagged"] == ["mean"]
    tail = token_check(_stats(1.7e-3, 2e-2, 0.5), noise, _stats(1e-3, 1e-2, 5e-2))
    assert tail["flagged"] == ["max"] and tail["ratios"]["max"] == pytest.approx(10.0)
    assert "nats/token" in clean["detectable"]


def test_token_check_identical_and_without_reference():
    assert token_check({**_stats(0.0, 0.0, 0.0), "max_abs_logit_diff": 0.0})["label"] == "identical"
    ok = token_check(_stats(-3.4e-9, 0.0, 1e-8, top1_agreement=1.0))
    assert ok["label"] == "agrees"
    bad = token_check(_stats(1e-3, 1e-2, 1e-1, top1_agreement=0.99))
    assert bad["flagged"] == ["top-1", "mean KL"]
    assert math.isinf(token_check(_stats(1e-3, 1e-2, 1e-1), _stats(0.0, 0.0, 0.0), _stats(1e-3, 1e-2, 1e-1))["ratios"]["mean"])


def test_report_lines_say_too_few_questions_and_zero_within_rounding():
    from swiglu_patch.evals.pairing import pair_records, records_by_filter
    from swiglu_patch.evals.report import task_verdict, token_verdict

    def sample(doc_id, lls, target):
        return {"doc_id": doc_id, "prompt_hash": str(doc_id), "filter": "none", "metrics": ["acc"],
                "filtered_resps": [(x, False) for x in lls], "acc": float(int(np.argmax(lls)) == target)}

    recs = records_by_filter([sample(i, [-1.0, -2.0], i % 2) for i in range(5)], "multiple_choice")["none"]
    answers = pair_records("t", recs, recs)
    paired, checks = answers.pop("paired"), answers.pop("checks")
    acc = sum(r.metrics["acc"] for r in recs.values()) / 5
    row = {"task": "t", "filter": "none", "kind": "task", "n": 5, "answers": answers, "checks": checks,
           "metrics": {"acc": {"eager": acc, "fused": acc, "diff": 0.0, "mdd_unpaired": mdd_unpaired(acc, 5),
                               "paired": paired["acc"]}}}
    line = task_verdict(row)["line"]
    assert "too few questions to detect a difference" in line and "pts paired" not in line
    tok = {"positions": 1024, "windows": 1, "window": 1024, "kl_mean": -3.4e-9, "kl_p99": 1e-8, "kl_max": 2e-8,
           "top1_agreement": 1.0, "top1_disagreements": 0, "max_abs_logit_diff": 1e-4, "ppl_eager": 19.551,
           "ppl_fused": 19.551, "ppl_rel_diff": 0.0, "reference": None}
    v = token_verdict(tok)
    assert v["label"] == "agrees" and "mean KL(eager||fused) 0 (within rounding: -3.4e-09) nats" in v["line"]
