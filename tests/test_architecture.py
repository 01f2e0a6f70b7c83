"""The package's layers, read from its source: imports point one way and never close a cycle.

Every import counts, also the ones inside functions (a lazy import can hold a cycle open).
- no cycle among the modules of swiglu_patch, swiglu_patch.kernels and swiglu_patch.evals;
- kernels/ knows tensors, never models: it imports nothing from swiglu_patch outside itself;
- inside kernels/, a kernel file imports only the leaves, and only the dispatchers import kernels;
- evals/ uses swiglu_patch's public API (the package itself), never its internals; besides it,
  only the tools' leaves: provenance (where a result ran) and inputs (argument and hub checks).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"swiglu_patch": ROOT / "swiglu_patch", "swiglu_patch.kernels": ROOT / "kernels",
            "swiglu_patch.evals": ROOT / "evals"}
LEAVES = {"layout", "epilogue", "reference", "configs", "device", "jit_common", "launcher"}
DISPATCHERS = {"dispatch"}
KERNEL_FILES = {"gated_gemm_pointer", "gated_gemm_tma", "gated_gemm_tma_grid", "gated_gemv", "gated_backward_pointer",
                "gated_backward_tma"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports (anywhere in the file)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ importing its own submodules is how packages export; count every other edge
    edges = {m: {d for d in deps if not (d.startswith(m + ".") and m in PACKAGES | {"swiglu_patch.memory": 0})}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_kernels_know_tensors_never_models():
    for name, deps in _graph().items():
        if name.startswith("swiglu_patch.kernels"):
            outside = {d for d in deps if not d.startswith("swiglu_patch.kernels")}
            assert not outside, f"{name} imports {sorted(outside)}: kernels/ must not import model code"


def test_kernel_files_import_only_leaves_and_only_dispatch_imports_kernels():
    graph = _graph()
    for name, deps in graph.items():
        if not name.startswith("swiglu_patch.kernels."):
            continue
        short = name.rsplit(".", 1)[1]
        local = {d.rsplit(".", 1)[1] for d in deps if d.startswith("swiglu_patch.kernels.")}
        if short in LEAVES or short in KERNEL_FILES:
            assert local <= LEAVES, f"{short} imports {sorted(local - LEAVES)}; a leaf or kernel file imports only leaves"
        if short not in DISPATCHERS:
            assert not (local & KERNEL_FILES), f"{short} imports kernel files {sorted(local & KERNEL_FILES)}"
    importers = {n for n, deps in graph.items() if any(d.rsplit(".", 1)[1] in KERNEL_FILES for d in deps
                                                      if d.startswith("swiglu_patch.kernels."))}
    assert importers <= {f"swiglu_patch.kernels.{d}" for d in DISPATCHERS}, importers


def test_evals_use_the_public_api():
    for name, deps in _graph().items():
        if name.startswith("swiglu_patch.evals"):
            internal = {d for d in deps if d.startswith("swiglu_patch.") and not d.startswith("swiglu_patch.evals")
                        and d not in ("swiglu_patch.provenance", "swiglu_patch.inputs")}
            assert not internal, f"{name} imports swiglu_patch internals {sorted(internal)}; use `from swiglu_patch import`"
