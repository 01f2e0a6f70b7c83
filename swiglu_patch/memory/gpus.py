"""GPU names to memory, in GiB, about what ``torch.cuda.mem_get_info()[1]`` reports on each.

The marketed "80 GB" of an H100 is 80 GiB of HBM of which the driver shows about 79; these
numbers are approximate (drivers and ECC settings move them by a few hundred MiB). For an exact
figure pass the number your GPU reports (``--gpu-mem-gib``).
"""

from __future__ import annotations


GPU_MEMORY_GIB: dict[str, float] = {
    "A10G": 22.0,
    "L4": 22.0,
    "RTX4090": 23.5,
    "A100-40GB": 39.6,
    "L40S": 44.4,
    "A100-80GB": 79.2,
    "H100": 79.1,  # H100 80GB (SXM and PCIe)
    "H100-NVL": 93.1,
    "H200": 139.8,
    "B200": 178.4,
    "MI300X": 191.5,
}

_ALIASES = {"H100-80GB": "H100", "H100-SXM": "H100", "H100-PCIE": "H100", "A100": "A100-80GB", "4090": "RTX4090"}


def gpu_memory_gib(name: str) -> float:
    """GiB of a GPU by name (case-insensitive; "H100", "A100-40GB", ...).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    key = name.strip().upper().replace(" ", "-").replace("_", "-")
    key = _ALIASES.get(key, key)
    for known, gib in GPU_MEMORY_GIB.items():
        if known.upper() == key:
            return gib
    raise ValueError(f"Unknown GPU {name!r}. Known: {', '.join(GPU_MEMORY_GIB)}; "
                     "or give the memory itself with --gpu-mem-gib.")
