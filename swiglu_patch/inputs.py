"""Checks of what a user names or types, shared by the command-line tools and their functions.

- argparse types (`positive_int`, `nonnegative_int`, `positive_float`, `nonnegative_float`,
  `fraction`, `int_list`, `existing_file`): a bad value becomes argparse's one-line error
  (exit status 2) that names the option, the value and what it must be.
- `check_source`: tells a local path from a Hugging Face hub id before anything loads, and
  fails at once with the fix when a hub id cannot be fetched now (``HF_HUB_OFFLINE=1`` and not
  in the local cache, or the hub unreachable), instead of transformers' and datasets' retries
  (about 24 s per file on a machine without the hub).

Nothing here imports torch, transformers or datasets: the command line's ``--help`` and its
argument errors stay fast.
"""

from __future__ import annotations

import argparse
import os
from functools import lru_cache
from pathlib import Path

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "ON", "YES", "TRUE"}
# Names ending like this are files, never hub ids.
_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".gguf", ".safetensors", ".bin", ".pt")


# -- argparse types ------------------------------------------------------------------------------

def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _number(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text, float, "a number > 0")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(text, float, "a number >= 0")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def open_fraction(text: str) -> float:
    """argparse type: a number in (0, 1), e.g. a significance level or a power."""
    value = _number(text, float, "a number between 0 and 1")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: "512,1024" -> [512, 1024] (integers >= 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def existing_file(text: str) -> Path:
    """argparse type: the path of a file that exists."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (it is a folder)" if path.is_dir() else ""))
    return path


# -- local path or hub id ------------------------------------------------------------------------

class SourceError(ValueError):
    """A model, tokenizer or dataset name that is neither a local path nor fetchable now.
    The message names the option, the value and the fix."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    return any(os.environ.get(v, "").strip().upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT`` or https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or DEFAULT_ENDPOINT


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers one HEAD request within `timeout` seconds (any HTTP status counts;
    proxies from the environment apply). Asked once per endpoint and process."""
    return _answers(hub_endpoint(), timeout)


@lru_cache(maxsize=8)
def _answers(url: str, timeout: float) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False
    return True


def looks_like_path(name: str) -> bool:
    """A name that can only be a path: starts with ``.``, ``/`` or ``~``, has more than one
    ``/`` (hub ids are ``owner/name``), or ends like a file (.json, .gguf, ...)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(_FILE_SUFFIXES)


def in_hub_cache(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    """Whether `filename` of hub repo `repo_id` is in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str)
    except Exception:  # noqa: BLE001 - no huggingface_hub, or not a valid repo id: not cached
        return False


def check_source(name: str, *, option: str, what: str = "model", repo_type: str = "model",
                 cache_file: str | None = "config.json") -> str:
    """Say whether `name` is a local path or a hub id, failing at once if it is neither usable.

    Args:
        name: what the user gave: a path, or a hub id (``owner/name``).
        option: the option it came from, for the message (``--model``).
        what: what it names, for the message ("model", "dataset", ...).
        repo_type: "model" or "dataset".
        cache_file: a file every such repo has (config.json for models), looked up in the
            local cache when offline; None to leave the offline case to the loading library.

    Returns:
        "local" (the path exists) or "hub".

    Raises:
        SourceError: a path that does not exist; or a hub id while ``HF_HUB_OFFLINE=1`` and not
            cached, or while the hub does not answer.
    """
    path = Path(name).expanduser()
    if path.exists():
        return "local"
    if looks_like_path(name):
        raise SourceError(f"{option} {name}: no such file or folder ({path.absolute()})")
    if hub_offline():
        if cache_file is None or in_hub_cache(name, cache_file, repo_type):
            return "hub"
        raise SourceError(
            f"{option} {name}: not a local path, and HF_HUB_OFFLINE=1 keeps the hub off (the {what} is not in "
            f"the local cache). Give a local folder, or run once without HF_HUB_OFFLINE=1 where the hub is reachable."
        )
    if not hub_reachable():
        raise SourceError(
            f"{option} {name}: not a local path, and the Hugging Face hub ({hub_endpoint()}) does not answer. "
            f"Give a local folder, or set HF_HUB_OFFLINE=1 to use the local cache without retrying."
        )
    return "hub"


def one_line(message: object) -> str:
    """`message` as one line (library errors often span several): whitespace runs become one space."""
    return " ".join(str(message).split())
