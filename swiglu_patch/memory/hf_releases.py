"""What the installed transformers allocates, where releases differ: the memory model follows the
installed release, and models the newest code where transformers is not installed.

- up to 5.17, the grouped_mm experts path masks expert-parallel sentinel rows on every call
  (`hf_masks_sentinels`; `moe_walk`);
- up to 5.20, loading with ``tp_plan="auto"`` leaves an untied input embedding whole on every rank
  (`hf_shards_input_embedding`; `weights.weight_bytes_per_gpu` with ``hf_tp_plan``);
- up to 5.23, DeepSeek's and GLM's router casts its weight to fp32 on every call
  (`hf_casts_router_weight`; `moe_walk`).

Each was measured on CPU under 5.17 against the live tensors (tests/memory, tests/distributed); the release
where each changed was read from the code of 5.18-5.23, and, for the embedding, by loading under 5.20-5.23.
"""

from __future__ import annotations

import functools
from importlib import metadata

SENTINELS_UNMASKED_FROM = (5, 18)  # grouped_mm masks sentinel rows only under expert parallelism
INPUT_EMBEDDING_SHARDED_FROM = (5, 21)  # tp_plan "auto" shards an untied input embedding over the vocabulary
ROUTER_WEIGHT_FP32_FROM = (5, 24)  # DeepSeek's and GLM's router weight is an fp32 parameter, not cast per call


@functools.cache
def installed_transformers() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, or None without it (the model follows the newest code)."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    return major, minor


def _before(release: tuple[int, int]) -> bool:
    version = installed_transformers()
    return version is not None and version < release


def hf_masks_sentinels() -> bool:
    """Whether grouped_mm masks expert-parallel sentinel rows on every call (transformers up to 5.17)."""
    return _before(SENTINELS_UNMASKED_FROM)


def hf_shards_input_embedding() -> bool:
    """Whether tensor parallelism shards an untied input embedding (transformers 5.21 on)."""
    return not _before(INPUT_EMBEDDING_SHARDED_FROM)


def hf_casts_router_weight() -> bool:
    """Whether a sigmoid-group router (DeepSeek, GLM) casts its weight to fp32 on every call (up to 5.23)."""
    return _before(ROUTER_WEIGHT_FP32_FROM)
