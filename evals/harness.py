"""Eager against fused on lm-eval tasks: the two runs, paired question by question.

`prepare_tasks` does every check that can fail (task names, local files, datasets) before a
model is touched. `compare_on_tasks` then runs lm-eval's own `simple_evaluate` twice on one
`HFLM` wrapping one loaded model: first unpatched, then patched in place, with the same
settings and seeds, and pairs the logged samples (`pairing.py`).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from swiglu_patch.inputs import hub_endpoint, hub_offline, hub_reachable

from .config import TaskOptions
from .errors import EvalSetupError
from .local_tasks import check_task_names, leaf_tasks, parse_local_data, render_overrides, task_manager
from .pairing import pair_records, records_by_filter
from .patching import Patcher
from .token_agreement import _cast_floating
from .stats import mdd_unpaired, proportion_stderr


@dataclass
class TaskPlan:
    """Checked tasks, ready to evaluate.

    Attributes:
        tasks: the requested task, group or tag names.
        leaves: {requested name: its leaf tasks}.
        include_path: folder of rendered local overrides (None when all tasks read the hub).
        local: {leaf task: description of its local files} (see `render_overrides`).
    """

    tasks: list[str]
    leaves: dict[str, list[str]]
    include_path: Path | None
    local: dict[str, dict] = field(default_factory=dict)
    _tm: object = field(default=None, repr=False)

    def task_manager(self):
        """The TaskManager for these tasks (built once, shared by both runs)."""
        if self._tm is None:
            self._tm = task_manager(self.include_path)
        return self._tm


def prepare_tasks(tasks: list[str], local_data: list[str] | dict | None, work_dir: Path, preload: bool = True) -> TaskPlan:
    """Check task names and local files, render overrides, and build the tasks once.

    Args:
        tasks: lm-eval task, group or tag names.
        local_data: ``TASK=PATH`` strings (or a parsed {task: path} dict).
        work_dir: where rendered task YAMLs go (``work_dir/lm_eval_tasks``).
        preload: build every task (loads its dataset) now, so a missing or unreachable
            dataset fails here rather than after the model has loaded.

    Returns:
        A `TaskPlan`.

    Raises:
        EvalSetupError: unknown task, bad local file, or a dataset that cannot load.
    """
    if not tasks:
        raise EvalSetupError("no tasks given; pass --tasks (e.g. --tasks leaderboard_mmlu_pro gpqa_diamond_zeroshot)")
    local = local_data if isinstance(local_data, dict) else parse_local_data(local_data)
    tm = task_manager()
    check_task_names(tm, tasks)
    include = Path(work_dir) / "lm_eval_tasks"
    rendered = render_overrides(tm, {k: Path(v) for k, v in local.items()}, tasks, include)
    plan = TaskPlan(
        tasks=list(tasks),
        leaves={t: leaf_tasks(tm, t) for t in tasks},
        include_path=include if rendered else None,
        local=rendered,
    )
    from_hub = sorted({leaf for leaves in plan.leaves.values() for leaf in leaves if _reads_hub(tm, leaf)} - set(rendered))
    if from_hub and not hub_offline() and not hub_reachable():
        raise EvalSetupError(
            f"tasks {', '.join(from_hub)} read their datasets from the Hugging Face hub ({hub_endpoint()}), which "
            "does not answer. Point them at local files with --local-data TASK=PATH, or set HF_HUB_OFFLINE=1 "
            "HF_DATASETS_OFFLINE=1 to use datasets already in the local cache."
        )
    if preload:
        try:
            plan.task_manager().load(list(tasks))
        except Exception as err:  # datasets, hub and YAML errors come in many types
            hint = ""
            if from_hub:
                hint = (f" {', '.join(from_hub)} read the hub" + (" (HF_HUB_OFFLINE=1 is set)" if hub_offline() else "")
                        + ": point them at local files with --local-data TASK=PATH.")
            raise EvalSetupError(f"lm-eval could not build {', '.join(tasks)}: {type(err).__name__}: {err}.{hint}") from err
    return plan


def _reads_hub(tm, leaf: str) -> bool:
    """Whether lm-eval's own YAML of `leaf` reads a hub dataset (not a local builder or path)."""
    entry = tm.task_index.get(leaf)
    path = ((entry.cfg or {}) if entry is not None else {}).get("dataset_path")
    return not (path in ("json", "csv", "parquet", "text", "arrow") or (path and Path(path).exists()))


def _strip(results: dict) -> dict:
    return {k: v for k, v in results.items() if k != "samples"}


def _metric_keys(task_results: dict) -> list[str]:
    return [k for k in task_results if "," in k and "_stderr," not in k]


def _float(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _row(name, kind, subtasks, output_type, filt, eager_res, fused_res, eager_recs, fused_recs, alpha, power,
         ref_recs=None, verdict=None) -> dict:
    """One report row: a task (or a group, pooled) under one filter."""
    answers = pair_records(name, eager_recs, fused_recs, alpha, power, ref_recs, verdict)
    paired = answers.pop("paired")
    checks = answers.pop("checks")
    metrics = {}
    for key in _metric_keys(eager_res):
        metric, _, f = key.partition(",")
        if f != filt or key not in fused_res:
            continue
        e, fu = _float(eager_res[key]), _float(fused_res[key])
        if e is None or fu is None:
            continue
        n = answers["n"]
        es = _float(eager_res.get(f"{metric}_stderr,{f}"))
        fs = _float(fused_res.get(f"{metric}_stderr,{f}"))
        p = paired.get(metric)
        if p:  # lm-eval's score must be the mean of the per-question values we paired
            for side, score, hits in (("eager", e, p["right_to_wrong"]), ("fused", fu, p["wrong_to_right"])):
                if abs((p["both_right"] + hits) / n - score) > 1e-6:
                    raise RuntimeError(
                        f"{name}: lm-eval reports {metric}={score} for the {side} run but its logged samples "
                        f"average {(p['both_right'] + hits) / n}; the samples and the scores disagree"
                    )
        metrics[metric] = {
            "eager": e, "fused": fu, "diff": fu - e,
            "eager_stderr": es if es is not None else (proportion_stderr(e, n) if p else None),
            "fused_stderr": fs if fs is not None else (proportion_stderr(fu, n) if p else None),
            "mdd_unpaired": mdd_unpaired(e, n, alpha, power) if p else None,
            "paired": p,
        }
    return {
        "task": name, "filter": filt, "kind": kind, "subtasks": subtasks, "output_type": output_type,
        "n": answers["n"], "metrics": metrics, "answers": answers, "checks": checks,
    }


def _pooled(res: dict, leaves: list[str], filt: str) -> dict:
    """Per-question mean of every metric over the leaves' samples (a group's own score)."""
    sums: dict[str, list[float]] = {}
    for leaf in leaves:
        for s in res["samples"].get(leaf, []):
            if str(s.get("filter", "none")) != filt:
                continue
            for m in s.get("metrics") or []:
                if isinstance(s.get(m), (int, float)):
                    sums.setdefault(m, []).append(float(s[m]))
    return {f"{m},{filt}": sum(v) / len(v) for m, v in sums.items() if v}


def build_rows(plan: TaskPlan, eager: dict, fused: dict, alpha: float = 0.05, power: float = 0.8,
               reference: dict | None = None, verdict: dict | None = None) -> tuple[list[dict], dict]:
    """Pair two `simple_evaluate` results (and the reference run's, if any) into report rows, one
    per (leaf task, filter), plus one pooled row per requested group or tag with more than one leaf.

    Returns:
        (rows, per-sample records {row name: [(doc key, eager record, fused record)]}).
    """
    rows, per_sample = [], {}
    all_leaves = sorted(eager["samples"])
    by_leaf = {}
    for leaf in all_leaves:
        otype = eager["configs"][leaf]["output_type"]
        e_by, f_by = records_by_filter(eager["samples"][leaf], otype), records_by_filter(fused["samples"].get(leaf, []), otype)
        r_by = records_by_filter(reference["samples"].get(leaf, []), otype) if reference is not None else None
        by_leaf[leaf] = (otype, e_by, f_by, r_by)
        for filt in e_by:
            name = leaf if filt == "none" else f"{leaf},{filt}"
            rows.append(_row(leaf, "task", [], otype, filt, eager["results"][leaf], fused["results"][leaf],
                             e_by[filt], f_by.get(filt, {}), alpha, power,
                             r_by.get(filt, {}) if r_by is not None else None, verdict))
            per_sample[name] = [(i, e_by[filt][i], f_by[filt].get(i)) for i in sorted(e_by[filt])]
    for req, leaves in plan.leaves.items():
        leaves = [leaf for leaf in leaves if leaf in by_leaf]
        if len(leaves) < 2 and req in by_leaf:
            continue
        otypes = {by_leaf[leaf][0] for leaf in leaves}
        for filt in sorted({f for leaf in leaves for f in by_leaf[leaf][1]}):
            e_recs, f_recs, r_recs = {}, {}, ({} if reference is not None else None)
            for k, leaf in enumerate(leaves):
                for side, recs in ((1, e_recs), (2, f_recs), (3, r_recs)):
                    if recs is None:
                        continue
                    for i, rec in by_leaf[leaf][side].get(filt, {}).items():
                        recs[k * 10**7 + i] = rec
            rows.append(_row(req, "group", leaves, "/".join(sorted(otypes)), filt, _pooled(eager, leaves, filt),
                             _pooled(fused, leaves, filt), e_recs, f_recs, alpha, power, r_recs, verdict))
    return rows, per_sample


@contextlib.contextmanager
def _lm_eval_git_hash():
    """lm-eval logs the git commit of the working directory by running ``git describe`` there,
    whose "fatal: not a git repository" reaches the terminal outside a repository. Its results
    get swiglu-patch's own commit instead (the one the report records), with no subprocess."""
    import lm_eval.evaluator

    from swiglu_patch.provenance import git_commit

    saved = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = lambda: git_commit().get("commit")
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = saved


def _write_samples(folder: Path, per_sample: dict, eager: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    targets = {
        (leaf, int(s["doc_id"])): s.get("target") for leaf, ss in eager["samples"].items() for s in ss
    }
    for name, items in per_sample.items():
        leaf = name.split(",")[0]
        with open(folder / f"{name.replace(',', '__')}.jsonl", "w", encoding="utf-8") as fh:
            for i, e, f in items:
                fh.write(json.dumps({
                    "doc_id": i, "prompt_hash": e.prompt_hash, "target": targets.get((leaf, i)),
                    "eager": {"answer": e.answer, "logliks": e.logliks, "metrics": e.metrics, "text": e.text},
                    "fused": None if f is None else {"answer": f.answer, "logliks": f.logliks, "metrics": f.metrics, "text": f.text},
                }, default=str) + "\n")


def compare_on_tasks(
    model,
    tokenizer,
    plan: TaskPlan,
    output_dir: Path,
    options: TaskOptions,
    *,
    patcher: Patcher | None = None,
    alpha: float = 0.05,
    power: float = 0.8,
    reference_dtype=None,
    verdict: dict | None = None,
) -> dict:
    """Run lm-eval on `model` unpatched, then (with a reference dtype) unpatched in that dtype,
    then patched, and pair the results.

    The model is left patched: the caller undoes it with ``patcher.restore(model)`` (as
    `run_eval` does).

    Args:
        model: a loaded causal LM (unpatched), on its evaluation device.
        tokenizer: its tokenizer.
        plan: from `prepare_tasks`.
        output_dir: per-sample JSONL (``samples/``) and lm-eval's raw results go here.
        options: limit, batch size, few-shot count, seed, generation arguments and chat
            template, the same for both runs (`TaskOptions`; its names and local_data are
            already in `plan`).
        patcher: how to make the fused model (default `Patcher()`: apply_fused_mlp, backend auto).
        alpha: significance level of the paired tests.
        power: power for minimum detectable differences.
        reference_dtype: a torch dtype for the reference run (the noise floor of the
            per-question verdict): the model is cast to it in place and back exactly; None: none.
        verdict: `verdicts.question_checks` thresholds (answer_ratio, loglik_ratio, change_max).

    Returns:
        {"rows": [...], "runs": {"eager": {...}, "fused": {...}}, "patch_report": str, "fused_path": str}.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    patcher = patcher or Patcher()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    o, seed = options, options.seed
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=o.batch_size)
    kwargs = dict(
        tasks=plan.tasks, num_fewshot=o.num_fewshot, batch_size=o.batch_size, limit=o.limit, log_samples=True,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        gen_kwargs=o.gen_kwargs, apply_chat_template=o.apply_chat_template,
    )
    runs, results = {}, {}
    sides = ("eager", "reference", "fused") if reference_dtype is not None else ("eager", "fused")
    ref_name = str(reference_dtype).replace("torch.", "")
    for side in sides:
        report = patcher.apply(model) if side == "fused" else None
        what = {"eager": "unpatched", "reference": f"unpatched, {ref_name}"}.get(side) or patcher.path(model)
        print(f"\n=== swiglu-patch eval: {side} run ({what}) ===", flush=True)
        old = _cast_floating(model, reference_dtype) if side == "reference" else None
        t0 = time.perf_counter()
        try:
            with _lm_eval_git_hash():
                res = lm_eval.simple_evaluate(model=hflm, task_manager=plan.task_manager(), **kwargs)
        finally:
            if old is not None:
                _cast_floating(model, old)
        runs[side] = {"seconds": time.perf_counter() - t0, "patch_report": report}
        results[side] = res
        with open(output_dir / f"lm_eval_{side}.json", "w", encoding="utf-8") as fh:
            json.dump(_strip(res), fh, indent=1, default=str)
    rows, per_sample = build_rows(plan, results["eager"], results["fused"], alpha, power, results.get("reference"), verdict)
    _write_samples(output_dir / "samples", per_sample, results["eager"])
    return {"rows": rows, "runs": runs, "patch_report": runs["fused"]["patch_report"], "fused_path": patcher.path(model)}
