"""The paired statistics and the pairing of lm-eval samples, checked against independent
computations (exact sums, scipy, Monte Carlo) rather than the code's own formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swiglu_patch.evals.pairing import pair_records, paired_binary, records_by_filter
from swiglu_patch.evals.stats import (
    mcnemar_exact,
    mdd_paired,
    mdd_unpaired,
    min_one_sided_flips,
    paired_diff_stderr,
    proportion_stderr,
)


@pytest.mark.parametrize("b, c, expected", [(0, 0, 1.0), (0, 6, 2 / 64), (1, 5, 2 * 7 / 64), (3, 3, 1.0), (5, 0, 2 / 32)])
def test_mcnemar_exact_hand_values(b, c, expected):
    assert mcnemar_exact(b, c) == pytest.approx(expected)
    assert mcnemar_exact(c, b) == pytest.approx(expected)


@pytest.mark.parametrize("b, c", [(0, 1), (2, 9), (10, 25), (40, 41), (120, 90)])
def test_mcnemar_exact_matches_scipy_binomtest(b, c):
    stats = pytest.importorskip("scipy.stats")
    assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_min_one_sided_flips():
    assert min_one_sided_flips(0.05) == 6  # 2 * 0.5**5 = 0.0625 >= 0.05 > 2 * 0.5**6
    assert min_one_sided_flips(0.01) == 8


def test_stderrs():
    assert proportion_stderr(0.5, 101) == pytest.approx(0.05)
    # paired: var of per-question difference d in {-1, 0, 1}
    d = np.array([1] * 7 + [-1] * 3 + [0] * 90, dtype=float)
    assert paired_diff_stderr(3, 7, 100) == pytest.approx(d.std() / math.sqrt(100))


def _power_two_proportions(p1, p2, n, alpha, rng, sims=4000):
    x1 = rng.binomial(n, p1, sims) / n
    x2 = rng.binomial(n, p2, sims) / n
    pooled = (x1 + x2) / 2
    se = np.sqrt(2 * pooled * (1 - pooled) / n)
    z = np.abs(x1 - x2) / np.where(se > 0, se, np.inf)
    return float(np.mean(z > 1.959964))


def test_mdd_unpaired_has_the_stated_power_by_simulation():
    rng = np.random.default_rng(0)
    for n, p in ((198, 0.3), (1000, 0.6)):
        d = mdd_unpaired(p, n)
        # the formula's variance is p(1-p) for both runs: proportions p +- d/2
        assert _power_two_proportions(p + d / 2, p - d / 2, n, 0.05, rng) == pytest.approx(0.8, abs=0.03)
    # GPQA Diamond cannot see less than ~13 points (the "about 12")
    assert 0.11 < mdd_unpaired(0.3, 198) < 0.14


def test_mdd_paired_has_about_the_stated_power_by_simulation():
    rng = np.random.default_rng(1)
    n, discordant = 2000, 100  # 5% of answers change
    d = mdd_paired(discordant, n)
    psi = discordant / n
    p_r2w, p_w2r = (psi + d) / 2, (psi - d) / 2
    hits = 0
    sims = 1500
    for _ in range(sims):
        counts = rng.multinomial(n, [p_r2w, p_w2r, 1 - psi])
        hits += mcnemar_exact(int(counts[0]), int(counts[1])) < 0.05
    assert hits / sims == pytest.approx(0.8, abs=0.06)
    assert d < mdd_unpaired(0.5, n)  # pairing is what buys the sensitivity


def test_mdd_paired_without_flips_is_k_min_over_n():
    assert mdd_paired(0, 1000) == pytest.approx(6 / 1000, rel=1e-6)
    assert mdd_paired(0, 10) <= 0.6 + 1e-12


def test_paired_binary_counts():
    a = [1, 1, 0, 0, 1, 0]
    b = [1, 0, 0, 1, 0, 0]
    p = paired_binary(a, b)
    assert (p.both_right, p.both_wrong, p.right_to_wrong, p.wrong_to_right) == (1, 2, 2, 1)
    assert p.mcnemar_p == pytest.approx(1.0)
    with pytest.raises(ValueError, match="pair them first"):
        paired_binary([1], [1, 0])


def _mc_sample(doc_id, lls, target, prompt="p"):
    choice = int(np.argmax(lls))
    return {
        "doc_id": doc_id, "prompt_hash": f"{prompt}{doc_id}", "filter": "none", "metrics": ["acc"],
        "filtered_resps": [(x, False) for x in lls], "resps": [[(x, False)] for x in lls], "acc": float(choice == target),
    }


def test_pair_records_multiple_choice():
    eager = [_mc_sample(0, [-1.0, -2.0], 0), _mc_sample(1, [-3.0, -2.5], 1), _mc_sample(2, [-1.0, -1.2], 1)]
    fused = [_mc_sample(0, [-1.0, -2.0], 0), _mc_sample(1, [-2.0, -2.5], 1), _mc_sample(2, [-1.3, -1.2], 1)]
    e = records_by_filter(eager, "multiple_choice")["none"]
    f = records_by_filter(fused, "multiple_choice")["none"]
    out = pair_records("t", e, f)
    assert out["n"] == 3 and out["answers_same"] == 1 and out["changed_doc_ids"] == [1, 2]
    assert out["max_abs_loglik_diff"] == pytest.approx(1.0)
    p = out["paired"]["acc"]
    assert (p["right_to_wrong"], p["wrong_to_right"], p["both_right"]) == (1, 1, 1)


def test_pair_records_generation_and_mismatched_prompts():
    def gen(doc_id, text, ans, prompt="p"):
        return {"doc_id": doc_id, "prompt_hash": prompt, "filter": "x", "metrics": ["exact_match"],
                "resps": [[text]], "filtered_resps": [ans], "exact_match": float(ans == "A")}

    e = records_by_filter([gen(0, "so A", "A"), gen(1, "hmm B", "B")], "generate_until")["x"]
    f = records_by_filter([gen(0, "so A!", "A"), gen(1, "hmm B", "B")], "generate_until")["x"]
    out = pair_records("t", e, f)
    assert out["identical_text"] == 1 and out["answers_same"] == 2 and out["max_abs_loglik_diff"] is None
    bad = records_by_filter([gen(0, "so A", "A", prompt="q"), gen(1, "hmm B", "B")], "generate_until")["x"]
    with pytest.raises(RuntimeError, match="different prompt"):
        pair_records("t", e, bad)
    with pytest.raises(RuntimeError, match="different questions"):
        pair_records("t", e, {0: e[0]})
