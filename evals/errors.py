"""The one error type of the accuracy harness's setup checks."""


class EvalSetupError(ValueError):
    """Bad input found before any evaluation starts: an unknown task, a missing or off-schema
    local file, a model that cannot be loaded or patched. The message names the fix."""
