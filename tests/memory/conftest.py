"""The memory tests' shared fixture."""

import pytest

from swiglu_patch.memory import hf_releases


@pytest.fixture
def newest_transformers(monkeypatch):
    """The memory model as it models the newest transformers, whichever is installed: hand-worked
    formulas are that code's, and older releases allocate more (`hf_releases`)."""
    monkeypatch.setattr(hf_releases, "installed_transformers", lambda: None)
