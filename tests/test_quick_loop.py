"""The fast loop (`pytest -m quick`, README "Tests") touches every patch at least once with real
megatron-core: each quick test names the patches it exercises (``@pytest.mark.quick("name", ...)``),
and together they name every patch megapatch ships; a name that is no patch is refused too."""

import pytest

from megapatch.core import engine


@pytest.mark.quick()
def test_the_quick_loop_names_every_patch_and_only_patches(request):
    named = {}
    for item in request.session.items:
        for mark in item.iter_markers("quick"):
            for patch in mark.args:
                named.setdefault(patch, []).append(item.nodeid)
    shipped = {p.name for p in engine.patches()}
    assert not set(named) - shipped, f"quick markers name no patch: {sorted(set(named) - shipped)}"
    missing = sorted(shipped - set(named))
    assert not missing, f"no quick test exercises {missing}: mark one with @pytest.mark.quick(...)"
