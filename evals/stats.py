"""Statistics for comparing two runs of one model on the same questions.

Scores are proportions (accuracy, exact match) over n questions; "pts" below are percentage
points. The functions are plain Python (no scipy) so the report needs nothing extra.

Two designs, two detectable differences:

- unpaired (what comparing two published accuracies can see): two independent proportions
  near p, each over n questions. The minimum detectable difference at two-sided level alpha
  with the given power is ``(z_{1-alpha/2} + z_{power}) * sqrt(2 p (1-p) / n)``. GPQA
  Diamond (n = 198, p ~ 0.3) gives about 13 pts: aggregate accuracy cannot see less.
- paired (what this harness does): the same n questions answered by both. Only discordant
  questions carry information; with b = right->wrong and c = wrong->right flips, McNemar's
  exact test is a two-sided binomial test of b against Binomial(b + c, 1/2). Its minimum
  detectable difference uses Connor's (1987) normal approximation with the discordance rate
  psi = (b + c) / n, and is never below k_min / n, where k_min is the smallest number of
  one-directional flips the exact test can call significant (6 at alpha = 0.05). Given the
  baseline score p, psi is capped at 2 p (1 - p), the discordance of two independent runs: a
  fused run whose answers scatter cannot make pairing look worse than not pairing. Below
  k_min questions, or where k_min / n exceeds that cap, the report says "too few questions
  to detect a difference" instead of a bound (`too_few_questions`).

`binom_tail` and `least_flagged` are the exact one-sided binomial tests of `verdicts.py`.
"""

from __future__ import annotations

import math
from statistics import NormalDist

_N = NormalDist()


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs.

    Args:
        b: pairs right in run 1 and wrong in run 2 (e.g. right -> wrong flips).
        c: pairs wrong in run 1 and right in run 2.

    Returns:
        p = min(1, 2 * P[X <= min(b, c)]) with X ~ Binomial(b + c, 1/2); 1.0 when b + c = 0.
    """
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    # sum_{i<=k} C(n, i) / 2^n, exactly in integers, then one division
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2.0 * tail / 2.0**n)


def min_one_sided_flips(alpha: float = 0.05) -> int:
    """Smallest k such that k flips all in one direction (and none back) give p < alpha.

    Args:
        alpha: two-sided significance level.

    Returns:
        k_min = the least k with 2 * 0.5^k < alpha (6 for alpha = 0.05).
    """
    _check_level(alpha, 0.5)
    k = 1
    while mcnemar_exact(k, 0) >= alpha:
        k += 1
    return k


def proportion_stderr(p: float, n: int) -> float:
    """Standard error of a proportion p over n items, sqrt(p (1-p) / (n-1)) (lm-eval's form).

    Args:
        p: the proportion in [0, 1].
        n: number of items.

    Returns:
        The stderr (nan when n < 2).
    """
    if n < 2:
        return float("nan")
    return math.sqrt(max(p * (1.0 - p), 0.0) / (n - 1))


def paired_diff_stderr(b: int, c: int, n: int) -> float:
    """Standard error of the paired difference (c - b) / n of two proportions.

    Args:
        b: right -> wrong flips.
        c: wrong -> right flips.
        n: paired questions.

    Returns:
        sqrt((psi - delta^2) / n) with psi = (b + c) / n and delta = (c - b) / n.
    """
    if n < 1:
        return float("nan")
    psi, delta = (b + c) / n, (c - b) / n
    return math.sqrt(max(psi - delta * delta, 0.0) / n)


def mdd_unpaired(p: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable difference between two independent proportions near p, n each
    (proportions p - d/2 and p + d/2, both with variance p(1-p)/n).

    Args:
        p: the baseline proportion (clipped to [1/n, 1 - 1/n] so it is never degenerate).
        n: items per run.
        alpha: two-sided significance level.
        power: probability of detecting a true difference of this size.

    Returns:
        The difference as a fraction (0.12 = 12 pts); inf when n < 2.
    """
    _check_level(alpha, 1.0)
    _check_level(power, 1.0)
    if n < 2:
        return float("inf")
    p = min(max(p, 1.0 / n), 1.0 - 1.0 / n)
    z = _N.inv_cdf(1.0 - alpha / 2.0) + _N.inv_cdf(power)
    return z * math.sqrt(2.0 * p * (1.0 - p) / n)


def mdd_paired(discordant: int, n: int, alpha: float = 0.05, power: float = 0.8, p: float | None = None) -> float:
    """Minimum detectable paired difference on n questions with the observed discordance.

    Solves Connor's sample-size equation
    ``sqrt(n) * delta = z_{1-alpha/2} sqrt(psi) + z_{power} sqrt(psi - delta^2)`` for delta,
    with psi = the discordance rate, bounded below by k_min / n (a run with no flips can still
    only detect a change big enough to produce k_min one-directional flips) and, given the
    baseline score p, above by 2 p (1 - p): the discordance of two independent runs. At that
    bound the paired design equals the unpaired one (`mdd_unpaired`), so the paired bound is
    never the larger of the two while k_min / n <= 2 p (1 - p); below that, see
    `too_few_questions`.

    Args:
        discordant: questions right in exactly one of the two runs (b + c).
        n: paired questions.
        alpha: two-sided significance level.
        power: probability of detecting a true difference of this size.
        p: the baseline score (eager's), or None for no upper bound on psi.

    Returns:
        delta as a fraction, at least k_min / n; inf when n < 1.
    """
    _check_level(alpha, 1.0)
    _check_level(power, 1.0)
    if n < 1:
        return float("inf")
    k_min = min_one_sided_flips(alpha)
    psi = min(max(discordant, k_min), n) / n
    if p is not None:
        q = min(max(p, 1.0 / n), 1.0 - 1.0 / n)  # as mdd_unpaired clips it
        psi = max(min(psi, 2.0 * q * (1.0 - q)), min(k_min / n, 1.0))
    za, zb = _N.inv_cdf(1.0 - alpha / 2.0), _N.inv_cdf(power)

    def gap(delta: float) -> float:  # increasing in delta
        return math.sqrt(n) * delta - za * math.sqrt(psi) - zb * math.sqrt(max(psi - delta * delta, 0.0))

    lo, hi = 0.0, psi
    if gap(hi) < 0:  # even psi (every discordant pair one way) is not enough at this power
        return max(psi, k_min / n)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return max(hi, k_min / n)


def too_few_questions(n: int, p: float, alpha: float = 0.05) -> bool:
    """Whether n questions are too few for the paired test to detect anything a comparison of
    two published scores could not: fewer than k_min questions (the exact test cannot reach
    alpha), or k_min / n above 2 p (1 - p), where the paired bound would exceed the unpaired one.

    Args:
        n: paired questions.
        p: the baseline score.
        alpha: two-sided significance level.
    """
    k_min = min_one_sided_flips(alpha)
    if n < k_min:
        return True
    q = min(max(p, 1.0 / n), 1.0 - 1.0 / n)
    return k_min / n > 2.0 * q * (1.0 - q)


def binom_tail(k: int, n: int, p: float) -> float:
    """P[X >= k] for X ~ Binomial(n, p), summed in log space (exact to float rounding).

    Args:
        k: the observed count (any integer; k <= 0 gives 1).
        n: trials (>= 0).
        p: success probability in [0, 1].
    """
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"binom_tail: need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p in (0.0, 1.0):
        return float(p == 1.0)
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def least_flagged(c: int, p0: float, level: float, n_max: int) -> int | None:
    """The smallest b such that b of b + c discordant pairs gives binom_tail(b, b + c, p0) < level.

    Args:
        c: discordant pairs the other way.
        p0: the null share of b.
        level: the test's level.
        n_max: b may not exceed this (the questions left); None if no b <= n_max is flagged.

    The tail falls as b grows (X_{m+1} <= X_m + 1), so a bisection finds b.
    """
    if n_max < 0 or binom_tail(n_max, n_max + c, p0) >= level:
        return None
    lo, hi = -1, n_max  # flagged at hi, not at lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mid >= 0 and binom_tail(mid, mid + c, p0) < level else (mid, hi)
    return hi


def _check_level(x: float, upper: float) -> None:
    if not 0.0 < x < upper:
        raise ValueError(f"expected a probability in (0, {upper}), got {x}")
