"""Pair lm-eval's logged samples of two runs question by question and compare them.

lm-eval (``log_samples=True``) logs one record per (question, filter) with ``doc_id``,
``doc_hash``, ``prompt_hash``, the raw ``resps``, the ``filtered_resps`` the metrics were
computed from, and each per-question metric value. From these:

- the chosen answer: for ``multiple_choice`` the index of the highest log-likelihood choice
  (what ``acc`` scores); for ``generate_until`` the filtered response (e.g. the extracted
  letter); for ``loglikelihood`` whether the continuation is the greedy one;
- the log-likelihoods: one per choice (``multiple_choice``), one per request otherwise;
  generation has none, and its raw text is compared instead.

Pairing is by (filter, doc_id); the two runs must have seen the same prompt (same
``prompt_hash``), or the comparison is meaningless and `pair_samples` raises.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .stats import mcnemar_exact, mdd_paired, paired_diff_stderr, too_few_questions
from .verdicts import question_checks


@dataclass
class QuestionRecord:
    """One question as one run answered it.

    Attributes:
        doc_id: lm-eval's index of the question within the task.
        prompt_hash: hash of the first request's context (identical prompts in both runs).
        answer: the chosen answer (choice index, filtered text or greedy flag).
        logliks: log-likelihoods in nats, one per choice or request ([] for generation).
        text: raw generated text (generation only, else None).
        metrics: per-question metric values, e.g. {"acc": 1.0}.
    """

    doc_id: int
    prompt_hash: str
    answer: object
    logliks: list[float]
    text: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def _as_ll(x) -> float:
    """A log-likelihood out of an lm-eval response: (ll, is_greedy) tuple or bare float."""
    if isinstance(x, (list, tuple)):
        x = x[0]
    return float(x)


def record_from_sample(sample: dict, output_type: str) -> QuestionRecord:
    """Turn one lm-eval sample dict into a `QuestionRecord`.

    Args:
        sample: an entry of ``results["samples"][task]``.
        output_type: the task's ``output_type`` (multiple_choice, generate_until,
            loglikelihood, loglikelihood_rolling).

    Returns:
        The record.
    """
    metric_names = sample.get("metrics") or []
    metrics = {m: float(sample[m]) for m in metric_names if isinstance(sample.get(m), (int, float, bool))}
    filtered = sample.get("filtered_resps")
    text = None
    if output_type == "multiple_choice":
        logliks = [_as_ll(r) for r in filtered]
        answer = max(range(len(logliks)), key=logliks.__getitem__) if logliks else None
    elif output_type == "generate_until":
        logliks = []
        answer = filtered[0] if isinstance(filtered, list) and len(filtered) == 1 else filtered
        raw = sample.get("resps") or [[None]]
        text = raw[0][0] if isinstance(raw[0], list) else raw[0]
    elif output_type == "loglikelihood":
        first = filtered[0] if isinstance(filtered, list) and filtered and isinstance(filtered[0], (list, tuple)) else filtered
        logliks = [_as_ll(first)]
        answer = bool(first[1]) if isinstance(first, (list, tuple)) and len(first) > 1 else None
    else:  # loglikelihood_rolling and anything that returns numbers
        value = filtered[0] if isinstance(filtered, list) and len(filtered) == 1 else filtered
        logliks = [_as_ll(value)] if isinstance(value, (int, float, list, tuple)) else []
        answer = None
    return QuestionRecord(
        doc_id=int(sample["doc_id"]),
        prompt_hash=str(sample.get("prompt_hash", "")),
        answer=answer,
        logliks=logliks,
        text=text,
        metrics=metrics,
    )


def records_by_filter(samples: list[dict], output_type: str) -> dict[str, dict[int, QuestionRecord]]:
    """Group a task's samples as {filter name: {doc_id: record}}.

    Args:
        samples: ``results["samples"][task]``.
        output_type: the task's output type.

    Returns:
        The nested dict; filter is lm-eval's filter name ("none" when the task has none).
    """
    out: dict[str, dict[int, QuestionRecord]] = {}
    for s in samples:
        out.setdefault(str(s.get("filter", "none")), {})[int(s["doc_id"])] = record_from_sample(s, output_type)
    return out


@dataclass
class PairedMetric:
    """Per-question agreement of one binary metric between run A (eager) and run B (fused).

    Attributes:
        n: paired questions.
        both_right, both_wrong: concordant pairs.
        right_to_wrong: right in A, wrong in B (b).
        wrong_to_right: wrong in A, right in B (c).
        mcnemar_p: exact two-sided McNemar p-value of b vs c.
        diff_stderr: stderr of the paired difference (B - A), as a fraction.
        mdd_paired: minimum detectable paired difference, as a fraction (never above the
            unpaired one for the same n and score; see `stats.mdd_paired`).
        too_few: n is too small for the paired test to detect anything (`stats.too_few_questions`);
            mdd_paired is then None.
    """

    n: int
    both_right: int
    both_wrong: int
    right_to_wrong: int
    wrong_to_right: int
    mcnemar_p: float
    diff_stderr: float
    mdd_paired: float | None
    too_few: bool = False


def paired_binary(a: list[float], b: list[float], alpha: float = 0.05, power: float = 0.8) -> PairedMetric:
    """Compare two equal-length lists of 0/1 scores question by question.

    Args:
        a: run A's per-question scores (0.0 or 1.0).
        b: run B's, same questions in the same order.
        alpha: significance level for the detectable difference.
        power: power for the detectable difference.

    Returns:
        A `PairedMetric`.
    """
    if len(a) != len(b):
        raise ValueError(f"paired_binary: runs have {len(a)} and {len(b)} questions; pair them first")
    rr = sum(1 for x, y in zip(a, b) if x and y)
    ww = sum(1 for x, y in zip(a, b) if not x and not y)
    r2w = sum(1 for x, y in zip(a, b) if x and not y)
    w2r = sum(1 for x, y in zip(a, b) if not x and y)
    n = len(a)
    p = sum(a) / n if n else 0.0
    few = too_few_questions(n, p, alpha)
    return PairedMetric(
        n=n, both_right=rr, both_wrong=ww, right_to_wrong=r2w, wrong_to_right=w2r,
        mcnemar_p=mcnemar_exact(r2w, w2r), diff_stderr=paired_diff_stderr(r2w, w2r, n),
        mdd_paired=None if few else mdd_paired(r2w + w2r, n, alpha, power, p), too_few=few,
    )


def _is_binary(values: list[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def pair_records(
    task: str, eager: dict[int, QuestionRecord], fused: dict[int, QuestionRecord], alpha: float = 0.05,
    power: float = 0.8, reference: dict[int, QuestionRecord] | None = None, verdict: dict | None = None,
) -> dict:
    """Compare one task's (one filter's) answers, question by question, and give the verdict.

    Args:
        task: task name, for error messages.
        eager: {doc_id: record} of the eager run.
        fused: {doc_id: record} of the fused run.
        alpha: significance level.
        power: power for detectable differences.
        reference: {doc_id: record} of the reference run (the unpatched model in higher
            precision: the noise floor), or None.
        verdict: keyword arguments of `verdicts.question_checks` besides the per-question data
            (answer_ratio, loglik_ratio, change_max).

    Returns:
        A JSON-ready dict: n, answers_same, answer_agreement, changed_doc_ids (first 50),
        max_abs_loglik_diff, mean_abs_loglik_diff (nats; None without log-likelihoods),
        identical_text (generation only), reference_answers_same (eager vs reference; None
        without one), ``paired`` = {metric: PairedMetric fields} for every metric whose
        per-question values are all 0/1, and ``checks``: the per-question verdict
        (`verdicts.question_checks`).

    Raises:
        RuntimeError: the runs did not see the same questions or prompts.
    """
    runs = {"fused": fused, **({"reference": reference} if reference is not None else {})}
    for side, recs in runs.items():
        if set(eager) != set(recs):
            missing = sorted(set(eager) ^ set(recs))[:10]
            raise RuntimeError(f"{task}: eager and {side} runs logged different questions (doc_ids {missing} ...)")
    ids = sorted(eager)
    for i in ids:
        for side, recs in runs.items():
            if eager[i].prompt_hash != recs[i].prompt_hash:
                raise RuntimeError(
                    f"{task}: doc {i} got a different prompt in the eager and {side} runs; the task is not "
                    "deterministic under a fixed seed (check its process_docs and few-shot sampler)"
                )
    same = [eager[i].answer == fused[i].answer for i in ids]
    diffs = [
        abs(x - y)
        for i in ids
        for x, y in zip(eager[i].logliks, fused[i].logliks)
        if math.isfinite(x) and math.isfinite(y)
    ]
    out = {
        "n": len(ids),
        "answers_same": sum(same),
        "answer_agreement": (sum(same) / len(ids)) if ids else float("nan"),
        "changed_doc_ids": [i for i, s in zip(ids, same) if not s][:50],
        "max_abs_loglik_diff": max(diffs) if diffs else None,
        "mean_abs_loglik_diff": (sum(diffs) / len(diffs)) if diffs else None,
        "identical_text": None,
        "paired": {},
    }
    if ids and eager[ids[0]].text is not None:
        out["identical_text"] = sum(eager[i].text == fused[i].text for i in ids)
    metric_names = sorted(set.intersection(*(set(eager[i].metrics) & set(fused[i].metrics) for i in ids))) if ids else []
    right = {}
    for m in metric_names:
        a = [eager[i].metrics[m] for i in ids]
        b = [fused[i].metrics[m] for i in ids]
        if _is_binary(a) and _is_binary(b):
            out["paired"][m] = paired_binary(a, b, alpha, power).__dict__
            right[m] = (a, b)
    ref = [reference[i] for i in ids] if reference is not None else None
    out["reference_answers_same"] = sum(reference[i].answer == eager[i].answer for i in ids) if ref else None
    has_ll = ref is not None and any(eager[i].logliks for i in ids)
    out["checks"] = question_checks(
        alpha=alpha, eager=[_key(eager[i]) for i in ids], fused=[_key(fused[i]) for i in ids],
        reference=[_key(r) for r in ref] if ref else None, right=right,
        logliks=([eager[i].logliks for i in ids], [fused[i].logliks for i in ids], [r.logliks for r in ref]) if has_ll else None,
        **(verdict or {}),
    )
    return out


def _key(rec: QuestionRecord) -> object:
    """What counts as the answer: the chosen answer, and for generation the text too."""
    return rec.answer if rec.text is None else (json.dumps(rec.answer, default=str), rec.text)
