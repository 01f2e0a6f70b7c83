"""Every record of the registry names a class that the installed transformers builds, where the
record says, with the projections the record names: a renamed class or attribute fails here."""

import pytest

from swiglu_patch.patch import find_gated
from swiglu_patch.registry import KNOWN_MLP_CLASSES
from zoo.tiny_zoo import build_or_skip

BY_TYPE: dict[str, list[str]] = {}
for record in KNOWN_MLP_CLASSES.values():
    BY_TYPE.setdefault(record.model_type, []).append(record.mlp_class)


@pytest.mark.parametrize("model_type", sorted(BY_TYPE))
def test_registry_classes_are_built_and_found(model_type):
    found, _ = find_gated(build_or_skip(model_type).model)
    known = {type(g.module).__name__ for g in found if g.known}
    assert set(BY_TYPE[model_type]) <= known, f"{model_type} builds {sorted(known)}"
    for g in found:
        if g.known:
            assert all(n in g.module._modules for n in g.family.projections), g.name
