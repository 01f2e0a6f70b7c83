"""The test process's environment: only tests/conftest.py turns Triton's interpreter on.

Triton reads TRITON_INTERPRET when it decorates a function. A module that set it when collection
imported it would leave a GPU machine's pytest process half interpreted: the kernels imported before
it compiled, every function decorated after it interpreted (`tests/distributed/fsdp2_common.py` did,
and 59 tests failed on an H200: docs/gpu_validation.md). A subprocess gets it in its own environment
(`helpers.interpreter_subprocess_env`); a test that needs it changed uses `monkeypatch`, which puts it back.
"""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SETS_INTERPRET = re.compile(r"""environ\s*(\.setdefault\(|\.update\(|\[)\s*["']TRITON_INTERPRET|putenv\(\s*["']TRITON_INTERPRET""")


def test_only_the_conftest_sets_triton_interpret_in_this_process():
    offenders = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py"))
                 if p not in (TESTS / "conftest.py", Path(__file__).resolve()) and SETS_INTERPRET.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"these set TRITON_INTERPRET in the test process: {offenders}"


def test_the_pattern_finds_what_it_must():
    assert SETS_INTERPRET.search('os.environ.setdefault("TRITON_INTERPRET", "1")')
    assert SETS_INTERPRET.search("os.environ['TRITON_INTERPRET'] = '1'")
    assert SETS_INTERPRET.search('os.putenv("TRITON_INTERPRET", "1")')
    assert SETS_INTERPRET.search((TESTS / "conftest.py").read_text(encoding="utf-8"))
    assert not SETS_INTERPRET.search('env = {**os.environ, "TRITON_INTERPRET": "1"}')
    assert not SETS_INTERPRET.search('monkeypatch.setenv("TRITON_INTERPRET", "1")')
