"""The README's CPU quickstart runs as written, and the README stays a page for users."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_cpu_quickstart_runs_as_written(capsys):
    code = _blocks("Quickstart")[0]
    assert "from_config" in code and "cuda" not in code
    exec(compile(code, "README.md quickstart", "exec"), {})
    assert "apply_fused_mlp: patched 2 MLP(s)" in capsys.readouterr().out


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200
