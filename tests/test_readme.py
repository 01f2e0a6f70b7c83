"""The README's CPU quickstart runs as written, and the README stays a page for users."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_cpu_quickstart_runs_as_written(capsys):
    first, _, training = _blocks("Quickstart")[:3]
    assert "from_config" in first and "cuda" not in first + training
    scope: dict = {}
    exec(compile(first, "README.md quickstart", "exec"), scope)
    assert "apply_fused_mlp: patched 2 MLP(s)" in capsys.readouterr().out
    exec(compile(training, "README.md training", "exec"), scope)
    lora_b = [p for n, p in scope["lora"].named_parameters() if "lora_B" in n and "gate_proj" in n]
    assert lora_b and all(p.grad is not None for p in lora_b)


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200
