"""Resolve lm-eval task names and point tasks at local files (offline MMLU-Pro and GPQA).

A local override keeps lm-eval's own task YAML and replaces only its dataset fields: the
templates in ``evals/tasks/`` are rendered, one per task, into a folder that is then given
to lm-eval's ``TaskManager(include_path=...)``, where a task of the same name replaces the
built-in one. Prompts, choices, few-shot sampling, filters and metrics stay lm-eval's.

Which template a task gets depends on the dataset its own YAML reads (`SCHEMAS`). A
``--local-data`` value names a task (or a group or tag, meaning all its tasks) and a path:

- a file: MMLU-Pro uses it for both test and validation (few-shot examples then come
  from the questions themselves); GPQA uses it as its one split;
- a folder: for each split S the template needs, the one file named ``S.<ext>`` or
  ``<anything>_S.<ext>``; for GPQA, ``<dataset_name>.<ext>`` (``gpqa_diamond.csv``) or
  ``train.<ext>``. Extensions: .jsonl/.json, .csv, .parquet.

Every file is checked for the schema's required columns before anything is evaluated.
"""

from __future__ import annotations

import csv
import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from .errors import EvalSetupError

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class LocalSchema:
    """How to point the tasks that read one hub dataset at local files.

    Attributes:
        name: short name used in messages.
        dataset_path: the ``dataset_path`` of lm-eval's task YAMLs that read this dataset.
        template: file under ``evals/tasks/`` with the dataset-field override.
        splits: the splits the template fills, in order (placeholders ``__SPLIT__``).
        required: columns every row must have.
    """

    name: str
    dataset_path: str
    template: str
    splits: tuple[str, ...]
    required: tuple[str, ...]


SCHEMAS = {
    s.dataset_path: s
    for s in (
        LocalSchema(
            "mmlu_pro", "TIGER-Lab/MMLU-Pro", "mmlu_pro_local.yaml", ("test", "validation"),
            ("question", "options", "answer", "answer_index", "category", "cot_content", "src"),
        ),
        LocalSchema(
            "gpqa", "Idavidrein/gpqa", "gpqa_local.yaml", ("train",),
            ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
        ),
    )
}


def parse_local_data(items: list[str] | None) -> dict[str, Path]:
    """Parse ``TASK=PATH`` strings into {task: absolute path}.

    Args:
        items: values of ``--local-data``.

    Returns:
        The mapping.

    Raises:
        EvalSetupError: an item without ``=`` or a path that does not exist.
    """
    out: dict[str, Path] = {}
    for item in items or []:
        task, sep, path = item.partition("=")
        if not sep or not task or not path:
            raise EvalSetupError(f"--local-data expects TASK=PATH (e.g. leaderboard_mmlu_pro=data/mmlu_pro), got {item!r}")
        p = Path(path).expanduser().resolve()
        if not p.exists():
            raise EvalSetupError(f"--local-data {task}: {p} does not exist; give a file or folder in the task's original schema")
        out[task] = p
    return out


def task_manager(include_path: str | Path | None = None):
    """lm-eval's TaskManager, with `include_path` taking precedence over built-in tasks.

    Indexing lm-eval's ~15k task YAMLs takes seconds, so the built-in-only manager is
    built once per process; one with an include path is built anew each call.
    """
    if include_path is None:
        return _builtin_task_manager()
    return _lm_eval_tasks().TaskManager(include_path=str(include_path))


@lru_cache(maxsize=1)
def _builtin_task_manager():
    return _lm_eval_tasks().TaskManager()


def _lm_eval_tasks():
    try:
        import lm_eval.tasks
    except ImportError as err:
        raise ImportError(
            f"lm-eval tasks need lm-eval ({err}): pip install 'lm_eval>=0.4.8' (or, in the swiglu-patch "
            "checkout, pip install -e '.[eval]'); "
            "the token-level check (--text) works without it"
        ) from err
    return lm_eval.tasks


def check_task_names(tm, tasks: list[str]) -> None:
    """Raise EvalSetupError naming every unknown task, with close matches.

    Args:
        tm: lm-eval TaskManager.
        tasks: requested task, group or tag names.
    """
    index = tm.task_index
    unknown = [t for t in tasks if t not in index]
    if unknown:
        hints = []
        for t in unknown:
            close = difflib.get_close_matches(t, list(index), n=3, cutoff=0.6)
            hints.append(f"{t!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise EvalSetupError(
            f"unknown lm-eval task(s): {'; '.join(hints)}. List them with `lm-eval ls tasks`."
        )


def leaf_tasks(tm, name: str) -> list[str]:
    """The leaf task names under a task, group or tag (a task is its own leaf)."""
    from lm_eval.tasks._index import Kind

    entry = tm.task_index[name]
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        return [name]
    members: list[str] = []
    if entry.kind == Kind.TAG:
        members = sorted(entry.tags)
    elif entry.kind == Kind.GROUP:
        for t in (entry.cfg or {}).get("task", []):
            members.append(t if isinstance(t, str) else t.get("task", t.get("group")))
    out: list[str] = []
    for m in members:
        out.extend(leaf_tasks(tm, m) if m in tm.task_index else [m])
    return out


def _builder(path: Path) -> str:
    b = _BUILDERS.get(path.suffix.lower())
    if b is None:
        raise EvalSetupError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_BUILDERS)}")
    return b


def _split_file(folder: Path, split: str, dataset_name: str | None) -> Path:
    stems = [split] + ([dataset_name] if dataset_name and split == "train" else [])
    found = [
        p for p in sorted(folder.iterdir())
        if p.suffix.lower() in _BUILDERS and any(p.stem == s or p.stem.endswith("_" + s) for s in stems)
    ]
    if len(found) != 1:
        wanted = " or ".join(f"{s}.jsonl/.csv/.parquet (or *_{s}.*)" for s in stems)
        raise EvalSetupError(
            f"{folder}: expected exactly one file for split {split!r} named {wanted}, found "
            f"{[p.name for p in found] or 'none'}"
        )
    return found[0]


def read_rows(path: Path, limit: int | None = None) -> list[dict]:
    """Read rows of a .jsonl/.json/.csv/.parquet file as dicts (the first `limit` rows)."""
    b = _builder(path)
    if b == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            return [row for _, row in zip(range(limit or 10**12), reader)]
    if b == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return table.slice(0, limit or table.num_rows).to_pylist()
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.split("\n") if line.strip()]  # not splitlines: U+2028 is valid inside JSON strings
    return rows[:limit] if limit else rows


def check_schema(path: Path, schema: LocalSchema) -> int:
    """Check that every row of `path` has the schema's columns; return the row count.

    Raises:
        EvalSetupError: the file is empty, unreadable, or a row misses a column (or, for
            MMLU-Pro, an answer letter disagrees with answer_index).
    """
    try:
        rows = read_rows(path)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise EvalSetupError(f"{path}: cannot read it as {_builder(path)}: {err}") from err
    if not rows:
        raise EvalSetupError(f"{path}: no rows")
    for i, row in enumerate(rows):
        missing = [c for c in schema.required if c not in row or row[c] is None]
        if missing:
            raise EvalSetupError(
                f"{path}: row {i} lacks {missing}; the {schema.name} schema needs {list(schema.required)}"
            )
        if schema.name == "mmlu_pro":
            opts, idx = row["options"], row["answer_index"]
            if not isinstance(opts, list) or not isinstance(idx, int) or not 0 <= idx < len(opts) or idx >= 10:
                raise EvalSetupError(f"{path}: row {i}: options must be a list and 0 <= answer_index < len(options) <= 10")
            if row["answer"] != "ABCDEFGHIJ"[idx]:
                raise EvalSetupError(f"{path}: row {i}: answer {row['answer']!r} is not letter {idx} of A-J")
    return len(rows)


def _template(name: str) -> dict:
    text = resources.files(__package__).joinpath("tasks", name).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _fill(obj, values: dict[str, str]):
    if isinstance(obj, dict):
        return {k: _fill(v, values) for k, v in obj.items()}
    if isinstance(obj, str) and obj in values:
        return values[obj]
    return obj


def render_overrides(tm, local: dict[str, Path], requested: list[str], out_dir: Path) -> dict[str, dict]:
    """Write one override YAML per leaf task under each ``--local-data`` key.

    Args:
        tm: TaskManager over lm-eval's built-in tasks.
        local: {task, group or tag: path} from `parse_local_data`.
        requested: the tasks asked for (every key of `local` must be one, or under one).
        out_dir: folder for the rendered YAMLs (created).

    Returns:
        {leaf task: {"schema", "files": {split: path}, "rows": {split: n}, "upstream"}}.

    Raises:
        EvalSetupError: a key is unknown or not requested, a task reads a dataset with no
            local schema, or a file is missing or off-schema.
    """
    if not local:
        return {}
    check_task_names(tm, list(local))
    requested_leaves = {leaf for r in requested for leaf in leaf_tasks(tm, r)}
    out_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    for key, path in local.items():
        leaves = leaf_tasks(tm, key)
        if not set(leaves) & requested_leaves:
            raise EvalSetupError(f"--local-data {key}: not among the requested tasks {requested}; add it to --tasks")
        for leaf in leaves:
            if leaf not in requested_leaves:
                continue
            entry = tm.task_index[leaf]
            cfg = entry.cfg or {}
            schema = SCHEMAS.get(cfg.get("dataset_path"))
            if schema is None:
                supported = ", ".join(f"{s.dataset_path} ({s.name})" for s in SCHEMAS.values())
                raise EvalSetupError(
                    f"--local-data {key}: task {leaf} reads {cfg.get('dataset_path')!r}; local files are "
                    f"supported for tasks reading {supported}"
                )
            files = {}
            for split in schema.splits:
                files[split] = path if path.is_file() else _split_file(path, split, cfg.get("dataset_name"))
            builders = {_builder(p) for p in files.values()}
            if len(builders) != 1:
                raise EvalSetupError(f"--local-data {key}: split files must share one format, got {sorted(builders)}")
            rows = {split: check_schema(p, schema) for split, p in files.items()}
            values = {"__UPSTREAM__": str(entry.yaml_path), "__TASK__": leaf, "__BUILDER__": builders.pop()}
            values.update({f"__{s.upper()}__": str(p) for s, p in files.items()})
            rendered = _fill(_template(schema.template), values)
            (out_dir / f"{leaf}.yaml").write_text(yaml.safe_dump(rendered, sort_keys=False), encoding="utf-8")
            done[leaf] = {
                "schema": schema.name, "upstream": str(entry.yaml_path),
                "files": {s: str(p) for s, p in files.items()}, "rows": rows,
            }
    return done
