"""Verdicts: does the fused model answer and predict as eager does, within the noise floor?

Plain functions over per-question and per-token numbers (lists or 1-D arrays); nothing here
knows lm-eval, models or tensors, so any pairwise comparison (a kernel, an MoE router) can use them.

**The noise floor** is eager's own distance from a higher-precision run of the same model (the
reference: float32 for a bf16/fp16 model, float64 for a float32 one). Rounding moves eager that
far from the model it approximates; a correct fused path rounds differently but no more, so it
strays from the reference about as far as eager does, and from eager about twice as far (two
independent roundings).

**Per question** (`question_checks`), each check at level alpha / (number of checks), so a
correct fused path is flagged with probability at most alpha (Bonferroni):

1. accuracy, per 0/1 metric: exact McNemar test of the right->wrong against the wrong->right
   flips, fused against eager (`accuracy_check`);
2. answers (`answer_check`): of the questions where exactly one of eager and fused picks an
   answer other than the reference's, fused is that one on b, eager on c. A fused path that
   departs from the reference at most `ratio` times as often as eager has b / (b + c) <=
   ratio / (1 + ratio); DIFFERENCE when the one-sided exact binomial test rejects that. Without
   a reference: the answers fused changes against eager, tested against a ceiling share
   `change_max` of the questions;
3. log-likelihood shifts (`loglik_check`, needs a reference): per question, the largest shift of
   any choice's log-likelihood from the reference's, s_f for fused and s_e for eager. DIFFERENCE
   when s_f > ratio * s_e on significantly more than half of the questions (exact sign test).

A destroyed model near chance keeps its accuracy while its answers scatter: checks 2 and 3
see that, check 1 cannot. Each check reports the smallest defect it could have seen.

**Per token** (`token_check`), from the statistics of three per-position KL arrays (nats): D =
KL(eager || fused), the noise floor N = KL(ref || eager), and F = KL(ref || fused).
DIFFERENCE when any of: mean F > mean_ratio * mean N (fused strays from the reference more
than eager), p99 D > tail_ratio * p99 N or max D > tail_ratio * max N (the fused-vs-eager tail
past twice-the-floor-and-then-some). Without a reference, the absolute rule: top-1 agreement
below `top1_min` or mean D above `kl_max`. A mean KL a hair below zero is rounding (the two
distributions are equal to fp32 precision) and counts as 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .stats import binom_tail, least_flagged, mcnemar_exact

# KL(p || q) in fp32 over a vocabulary: sums of V terms each rounded at ~6e-8 relative
KL_ROUNDING = 1e-6


def clamp_kl(x: float) -> float:
    """A mean KL that rounding pushed below zero (|x| <= `KL_ROUNDING`) reads as 0."""
    return 0.0 if -KL_ROUNDING <= x < 0.0 else x


def kl_stats(kl: Sequence[float]) -> dict:
    """{kl_mean, kl_median, kl_p99, kl_max, positions} of per-position KL values (nats).

    Quantiles are linear interpolation between order statistics (numpy's and torch's default).
    """
    xs = sorted(float(x) for x in kl)
    if not xs:
        raise ValueError("kl_stats: no positions")

    def q(f: float) -> float:
        pos = f * (len(xs) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"kl_mean": sum(xs) / len(xs), "kl_median": q(0.5), "kl_p99": q(0.99), "kl_max": xs[-1], "positions": len(xs)}


# -- per question -----------------------------------------------------------------------------------


def accuracy_check(eager_right: Sequence[float], fused_right: Sequence[float], level: float) -> dict:
    """Exact McNemar test of one 0/1 metric, fused against eager.

    Args:
        eager_right, fused_right: per-question 0/1 scores, the same questions in the same order.
        level: the test's significance level.

    Returns:
        {check, flagged, p, right_to_wrong, wrong_to_right, level, detectable}: detectable is
        the fewest one-way flips (with none back) the test would flag, or None if n is too small.
    """
    if len(eager_right) != len(fused_right):
        raise ValueError(f"accuracy_check: {len(eager_right)} and {len(fused_right)} questions; pair them first")
    b = sum(1 for x, y in zip(eager_right, fused_right) if x and not y)
    c = sum(1 for x, y in zip(eager_right, fused_right) if y and not x)
    p = mcnemar_exact(b, c)
    k = next((k for k in range(1, len(eager_right) + 1) if mcnemar_exact(k, 0) < level), None)
    return {"check": "accuracy", "flagged": p < level, "p": p, "right_to_wrong": b, "wrong_to_right": c,
            "level": level, "detectable": k}


def answer_check(eager: Sequence, fused: Sequence, reference: Sequence | None, level: float,
                 ratio: float = 1.25, change_max: float = 0.05) -> dict:
    """Answers chosen by fused against eager's, calibrated by eager's own departures from the reference.

    Args:
        eager, fused: per-question chosen answers (any comparable values).
        reference: the reference run's answers, or None.
        level: the test's significance level.
        ratio: with a reference, how many times eager's departures fused may have (>= 1).
        change_max: without a reference, the share of changed answers allowed.

    Returns:
        {check, flagged, p, n, changed (fused vs eager), level, rule, detectable, ...}; with a
        reference also fused_departs (b), eager_departs (c), eager_vs_reference (eager's own
        changed answers: the noise floor); detectable = the fewest fused-only departures
        (given c) or changed answers the test flags, None if no count up to n would be.
    """
    n = len(eager)
    if len(fused) != n or (reference is not None and len(reference) != n):
        raise ValueError("answer_check: eager, fused and reference need the same questions in the same order")
    changed = sum(1 for e, f in zip(eager, fused) if e != f)
    out = {"check": "answers", "n": n, "changed": changed, "level": level}
    if reference is None:
        p = binom_tail(changed, n, change_max) if n else 1.0
        k = next((m for m in range(n + 1) if binom_tail(m, n, change_max) < level), None) if n else None
        out.update(flagged=p < level, p=p, detectable=k,
                   rule=f"changed answers <= {change_max:g} of the questions (no reference run)")
        return out
    b = sum(1 for e, f, r in zip(eager, fused, reference) if f != r and e == r)
    c = sum(1 for e, f, r in zip(eager, fused, reference) if e != r and f == r)
    share = ratio / (1.0 + ratio)
    p = binom_tail(b, b + c, share)
    out.update(
        flagged=p < level, p=p, fused_departs=b, eager_departs=c,
        eager_vs_reference=sum(1 for e, r in zip(eager, reference) if e != r),
        detectable=least_flagged(c, share, level, n - c),
        rule=f"fused departs from the reference answer <= {ratio:g} x as often as eager",
    )
    return out


def _max_shift(a: Sequence[float], r: Sequence[float]) -> float | None:
    shifts = [abs(x - y) for x, y in zip(a, r) if math.isfinite(x) and math.isfinite(y)]
    return max(shifts) if shifts else None


def loglik_check(eager_ll: Sequence[Sequence[float]], fused_ll: Sequence[Sequence[float]],
                 reference_ll: Sequence[Sequence[float]], level: float, ratio: float = 2.0) -> dict:
    """Sign test of per-question log-likelihood shifts from the reference: fused's against eager's.

    Args:
        eager_ll, fused_ll, reference_ll: per question, one log-likelihood per choice (nats).
        level: the test's significance level.
        ratio: a question counts against fused when its shift exceeds `ratio` x eager's.

    Returns:
        {check, flagged, p, n (questions with a decision), worse (s_f > ratio s_e), level, rule,
        median_shift_eager, median_shift_fused, detectable}: detectable = the fewest "worse"
        questions out of n that the test flags, None if n is too small.
    """
    pairs = []
    for e, f, r in zip(eager_ll, fused_ll, reference_ll):
        se, sf = _max_shift(e, r), _max_shift(f, r)
        if se is not None and sf is not None:
            pairs.append((se, sf))
    decided = [(se, sf) for se, sf in pairs if sf != ratio * se]
    worse = sum(1 for se, sf in decided if sf > ratio * se)
    m = len(decided)
    p = binom_tail(worse, m, 0.5) if m else 1.0
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {
        "check": "logliks", "flagged": p < level, "p": p, "n": m, "worse": worse, "level": level,
        "median_shift_eager": med([se for se, _ in pairs]), "median_shift_fused": med([sf for _, sf in pairs]),
        "detectable": next((k for k in range(m + 1) if binom_tail(k, m, 0.5) < level), None),
        "rule": f"shift from the reference > {ratio:g} x eager's on at most half of the questions",
    }


def question_checks(*, alpha: float, eager: Sequence, fused: Sequence, reference: Sequence | None = None,
                    right: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
                    logliks: tuple | None = None, answer_ratio: float = 1.25, loglik_ratio: float = 2.0,
                    change_max: float = 0.05) -> dict:
    """The per-question verdict: every check that the data allows, at alpha / (number of checks).

    Args:
        alpha: the verdict's false-alarm level.
        eager, fused, reference: per-question chosen answers (reference None: no reference run).
        right: {metric: (eager 0/1 scores, fused 0/1 scores)} for the accuracy checks.
        logliks: (eager, fused, reference) per-question log-likelihood lists, or None.
        answer_ratio, loglik_ratio, change_max: the checks' thresholds (see `answer_check`,
            `loglik_check`).

    Returns:
        {label: "DIFFERENCE" | "no detectable difference", flagged: [check names], checks: [...]}.
    """
    use_ll = logliks is not None and reference is not None and any(len(x) for x in logliks[0])
    k = len(right or {}) + 1 + int(use_ll)
    level = alpha / k
    checks = [{**accuracy_check(e, f, level), "metric": m} for m, (e, f) in (right or {}).items()]
    checks.append(answer_check(eager, fused, reference, level, answer_ratio, change_max))
    if use_ll:
        checks.append(loglik_check(*logliks, level, loglik_ratio))
    flagged = [c["check"] + (f" ({c['metric']})" if "metric" in c else "") for c in checks if c["flagged"]]
    return {"label": "DIFFERENCE" if flagged else "no detectable difference", "flagged": flagged, "checks": checks,
            "level_each": level}


# -- per token ------------------------------------------------------------------------------------


def token_check(fused_vs_eager: dict, noise: dict | None = None, fused_vs_reference: dict | None = None, *,
                mean_ratio: float = 1.2, tail_ratio: float = 4.0, top1_min: float = 0.999,
                kl_max: float = 1e-4) -> dict:
    """The token verdict from KL statistics (dicts with kl_mean, kl_p99, kl_max; see `kl_stats`).

    Args:
        fused_vs_eager: statistics of D = KL(eager || fused), plus top1_agreement and
            max_abs_logit_diff when known.
        noise: statistics of N = KL(ref || eager), or None without a reference.
        fused_vs_reference: statistics of F = KL(ref || fused) (with `noise`).
        mean_ratio: largest mean F / mean N.
        tail_ratio: largest p99 D / p99 N and max D / max N.
        top1_min, kl_max: the rule without a reference.

    Returns:
        {label: "identical" | "agrees" | "DIFFERENCE", flagged: [rule parts that failed],
        rule, ratios: {mean, p99, max}, detectable: the smallest defect the rule sees, in words}.
    """
    d = fused_vs_eager
    if d.get("max_abs_logit_diff") == 0.0:
        return {"label": "identical", "flagged": [], "rule": "no logit changed", "ratios": {}, "detectable": None}
    if noise is None:
        flagged = []
        if d.get("top1_agreement", 1.0) < top1_min:
            flagged.append("top-1")
        if clamp_kl(d["kl_mean"]) > kl_max:
            flagged.append("mean KL")
        return {"label": "DIFFERENCE" if flagged else "agrees", "flagged": flagged, "ratios": {},
                "rule": f"top-1 agreement >= {top1_min:g} and mean KL(eager||fused) <= {kl_max:g} nats (no reference)",
                "detectable": f"a defect that moves the mean KL past {kl_max:g} nats or changes more than "
                              f"{100 * (1 - top1_min):g}% of the top-1 tokens"}
    f = fused_vs_reference

    def ratio(x: float, y: float) -> float:
        x = clamp_kl(x)
        return 0.0 if x == 0.0 else (x / y if y > 0 else math.inf)

    ratios = {"mean": ratio(f["kl_mean"], clamp_kl(noise["kl_mean"])),
              "p99": ratio(d["kl_p99"], noise["kl_p99"]), "max": ratio(d["kl_max"], noise["kl_max"])}
    limits = {"mean": mean_ratio, "p99": tail_ratio, "max": tail_ratio}
    flagged = [k for k in ratios if ratios[k] > limits[k]]
    return {
        "label": "DIFFERENCE" if flagged else "agrees", "flagged": flagged, "ratios": ratios,
        "rule": (f"mean KL(ref||fused) <= {mean_ratio:g} x mean KL(ref||eager); p99 and max KL(eager||fused) <= "
                 f"{tail_ratio:g} x those of KL(ref||eager)"),
        "detectable": (f"a defect adding {(mean_ratio - 1) * clamp_kl(noise['kl_mean']):.2g} nats/token to the mean "
                       f"KL from the reference, or a fused-vs-eager KL tail past p99 {tail_ratio * noise['kl_p99']:.2g} "
                       f"/ max {tail_ratio * noise['kl_max']:.2g} nats"),
    }
