"""The model zoo: every model type of the installed transformers' causal-LM and image-text-to-text
mappings, and the config variants real checkpoints use (`VARIANTS`), as a tiny random model through
`examine` (tests/zoo/examine.py): each gated module is patched exactly or refused with its reason,
nothing crashes, unpatch and save/reload are exact. About 10 minutes on 2 cores: slow (CI runs it).

A type that cannot be built small is skipped with the reason recorded in `CANNOT_BUILD`; a type
that fails to build for another reason, or a recorded one that builds now, fails the test (on a
transformers older than the records, `tiny_zoo.RECORDED_WITH`, the first is skipped with its reason
and the second examined).
"""

import pytest

from zoo.examine import examine
from zoo.tiny_zoo import CANNOT_BUILD, VARIANTS, model_types, older_transformers, skip_if_older

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_type, variant", [(t, "default") for t in model_types()] + sorted(VARIANTS))
def test_zoo(model_type, variant):
    row = examine(model_type, variant)
    if row.status == "could not build":
        reason = row.notes[0]
        expected = CANNOT_BUILD.get(model_type)
        if expected is None or not reason.startswith(expected[0]):
            skip_if_older(model_type, reason)
        assert expected is not None, f"{model_type} no longer builds: {reason}"
        assert reason.startswith(expected[0]), f"{model_type} fails to build differently: {reason}"
        pytest.skip(f"{model_type} cannot be built small: {expected[1]} ({reason})")
    assert model_type not in CANNOT_BUILD or variant != "default" or older_transformers(), \
        f"{model_type} builds now: drop it from CANNOT_BUILD"
    assert not row.failures, "\n".join(row.failures) + f"\n{row.report}"
