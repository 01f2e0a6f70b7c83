"""What one `run_eval` does, as one frozen record: `EvalConfig` and its four groups.

    EvalConfig(
        output_dir="out",
        load=LoadOptions(dtype="bfloat16"),                      # how a path or hub id is loaded
        tasks=TaskOptions(names=("gpqa_diamond_zeroshot",)),     # lm-eval part (None: skip it)
        text=TextOptions(path="austen.txt", window=512),         # token-level part (None: skip it)
        thresholds=Thresholds(alpha=0.05),                       # verdicts
    )

`swiglu-patch eval` builds one from its options; Python users build one directly. Every
field is checked when the record is made, so a bad value fails before anything loads, with
an `EvalSetupError` that names the field and the fix. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EvalSetupError

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "triton", "torch")
REFERENCE_DTYPES = ("auto", "none", "float32", "float64")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EvalSetupError(message)


def _tuple(value, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    _require(all(isinstance(v, str) for v in value), f"{name} must be strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class LoadOptions:
    """How the model is loaded (when `run_eval` gets a path or hub id) and patched.

    Attributes:
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        device: "cpu", "cuda", "cuda:1", ...; None: cuda when available, else cpu.
        gguf_file: a GGUF file name inside the model folder (needs the gguf package).
        backend: `apply_fused_mlp` backend: "auto" (Triton on CUDA, the PyTorch reference
            elsewhere), "triton" (on CPU only under TRITON_INTERPRET=1) or "torch".
        strict: refuse a model with any gated MLP that cannot be patched.
    """

    dtype: str = "auto"
    device: str | None = None
    gguf_file: str | None = None
    backend: str = "auto"
    strict: bool = True

    def __post_init__(self):
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


@dataclass(frozen=True)
class TaskOptions:
    """The lm-eval part: tasks run eager, then fused, with the same settings and seeds.

    Attributes:
        names: lm-eval task, group or tag names (at least one).
        local_data: ``TASK=PATH`` items pointing tasks at local files in the original schema.
        limit: questions per task (an int >= 1), or a fraction of each task (0 < x < 1).
        batch_size: lm-eval batch size: an int >= 1, or "auto" / "auto:N".
        num_fewshot: few-shot examples (None: each task's own).
        seed: python, numpy, torch and few-shot seed, the same for both runs.
        gen_kwargs: generation overrides for generative tasks, e.g. "max_gen_toks=256".
        apply_chat_template: lm-eval's flag.
        reference_dtype: a third run, the unpatched model in this dtype: the noise floor of the
            per-question verdict. "auto" (float32 for a bf16/fp16 model, float64 for float32),
            "none", "float32", "float64".
    """

    names: tuple[str, ...]
    local_data: tuple[str, ...] = ()
    limit: int | float | None = None
    batch_size: int | str = 1
    num_fewshot: int | None = None
    seed: int = 0
    gen_kwargs: str | None = None
    apply_chat_template: bool = False
    reference_dtype: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "names", _tuple(self.names, "task names"))
        _require(self.reference_dtype in REFERENCE_DTYPES,
                 f"reference_dtype must be one of {', '.join(REFERENCE_DTYPES)}, got {self.reference_dtype!r}")
        object.__setattr__(self, "local_data", _tuple(self.local_data, "local_data items"))
        _require(bool(self.names), "no tasks given; name at least one (e.g. leaderboard_mmlu_pro gpqa_diamond_zeroshot)")
        if self.limit is not None:
            ok = (isinstance(self.limit, int) and self.limit >= 1) or (isinstance(self.limit, float) and 0 < self.limit < 1)
            _require(ok, f"limit must be a count >= 1 or a fraction between 0 and 1, got {self.limit!r}")
        b = self.batch_size
        ok = (isinstance(b, int) and b >= 1) or (isinstance(b, str) and (b == "auto" or b.startswith("auto:")))
        _require(ok, f"batch_size must be an integer >= 1 or 'auto' (or 'auto:N'), got {b!r}")
        _require(self.num_fewshot is None or self.num_fewshot >= 0, f"num_fewshot must be >= 0, got {self.num_fewshot}")


@dataclass(frozen=True)
class TextOptions:
    """The token-level part: eager and fused logits compared position by position on text.

    Attributes:
        path: a UTF-8 text file; or
        dataset: a dataset (local .jsonl/.json/.csv/.parquet/.txt, or a hub id), with
        split: its split, and
        column: its text column.
        window: tokens per window, the tokenizer's prefix (e.g. <bos>) included.
        max_tokens: cap on the tokens compared, in whole windows (None: all the text).
        batch_size: windows per forward pass.
        reference_dtype: also run the unpatched model in this dtype and compare both with it:
            "auto" (float32 for a bf16/fp16 model, float64 for float32), "none", "float32", "float64".
    """

    path: str | None = None
    dataset: str | None = None
    split: str = "train"
    column: str = "text"
    window: int = 512
    max_tokens: int | None = None
    batch_size: int = 8
    reference_dtype: str = "auto"

    def __post_init__(self):
        _require((self.path is None) != (self.dataset is None),
                 "give exactly one text: a file (--text) or a dataset (--text-dataset)")
        _require(self.window >= 2, f"window must be >= 2 tokens, got {self.window}")
        _require(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(self.batch_size >= 1, f"text batch_size must be >= 1, got {self.batch_size}")
        _require(self.reference_dtype in REFERENCE_DTYPES,
                 f"reference_dtype must be one of {', '.join(REFERENCE_DTYPES)}, got {self.reference_dtype!r}")

    @property
    def source(self) -> str:
        """The text's name, for the report."""
        return self.path if self.path is not None else f"{self.dataset} [{self.split}].{self.column}"


@dataclass(frozen=True)
class Thresholds:
    """When a verdict says DIFFERENCE (verdicts.py explains each rule).

    Attributes:
        alpha: false-alarm level of the per-question verdict, split over its checks (0 < alpha < 1).
        power: power of the minimum detectable differences (0 < power < 1).
        top1_min: token verdict without a reference: least top-1 agreement.
        kl_max: token verdict without a reference: largest mean KL, nats per token.
        ratio_max: token verdict with a reference: largest mean KL(ref || fused) / mean KL(ref || eager).
        tail_ratio: token verdict with a reference: largest p99 (and max) of KL(eager || fused)
            over that of KL(ref || eager).
        answer_ratio: per question, with a reference: how many times eager's departures from
            the reference answers fused may have.
        loglik_ratio: per question: a question's log-likelihood shift from the reference counts
            against fused above this many times eager's.
        change_max: per question, without a reference: the share of answers fused may change.
    """

    alpha: float = 0.05
    power: float = 0.8
    top1_min: float = 0.999
    kl_max: float = 1e-4
    ratio_max: float = 1.2
    tail_ratio: float = 4.0
    answer_ratio: float = 1.25
    loglik_ratio: float = 2.0
    change_max: float = 0.05

    def __post_init__(self):
        _require(0 < self.alpha < 1, f"alpha must be between 0 and 1, got {self.alpha}")
        _require(0 < self.power < 1, f"power must be between 0 and 1, got {self.power}")
        _require(0 <= self.top1_min <= 1, f"top1_min must be between 0 and 1, got {self.top1_min}")
        _require(self.kl_max >= 0, f"kl_max must be >= 0, got {self.kl_max}")
        for name in ("ratio_max", "tail_ratio", "answer_ratio", "loglik_ratio"):
            value = getattr(self, name)
            _require(value >= 1, f"{name} must be >= 1 (fused no worse than eager), got {value}")
        _require(0 < self.change_max < 1, f"change_max must be between 0 and 1, got {self.change_max}")

    def question_options(self) -> dict:
        """The per-question checks' thresholds, as `verdicts.question_checks` takes them."""
        return {"answer_ratio": self.answer_ratio, "loglik_ratio": self.loglik_ratio, "change_max": self.change_max}


@dataclass(frozen=True)
class EvalConfig:
    """Everything one `run_eval` does. At least one of `tasks` and `text` is given.

    Attributes:
        output_dir: report.json, report.md, samples/ and lm-eval's raw results go here
            (created only once every input has been checked).
        load: how the model is loaded and patched.
        tasks: the lm-eval part, or None.
        text: the token-level part, or None.
        thresholds: the verdict rules.
        print_summary: print the verdicts when done.
        progress: show progress bars (tqdm, on stderr) for the token-level comparison.
    """

    output_dir: str | Path = "swiglu_eval"
    load: LoadOptions = field(default_factory=LoadOptions)
    tasks: TaskOptions | None = None
    text: TextOptions | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    print_summary: bool = True
    progress: bool = True

    def __post_init__(self):
        _require(self.tasks is not None or self.text is not None,
                 "nothing to do: give tasks (--tasks), a text file (--text) or a dataset (--text-dataset)")

    def to_dict(self) -> dict:
        """The record as plain JSON-ready data (for the report's ``config``)."""
        out = dataclasses.asdict(self)
        out["output_dir"] = str(self.output_dir)
        return out
