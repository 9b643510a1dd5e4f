import functools
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

import megapatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))  # the tools' modules (te_releases, matrix) for their tests


@pytest.fixture(autouse=True)
def _megapatch_off_around_each_test(monkeypatch):
    """Every test starts and ends with megapatch disabled and no MEGAPATCH_* variable set."""
    for key in list(os.environ):
        if key.startswith("MEGAPATCH_"):
            monkeypatch.delenv(key)
    megapatch.disable()
    yield
    megapatch.disable()


@functools.lru_cache(maxsize=None)
def te_installed() -> bool:
    """Transformer Engine's Python package and its PyTorch extension are installed (checked without
    importing TE: the TE tests run in a venv with TE, ../shared/te-cpu/install.sh, CI's te stage)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.metadata.distribution("transformer_engine_torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.te``: what only a venv with Transformer Engine can run; skipped without it, with
    the recipe. ``@pytest.mark.te(required=False)``: runs anywhere and checks what changes with TE
    installed. CI's te stage runs the marked tests alone (``-m te``): the rest ran in the default stage."""
    if te_installed():
        return
    skip = pytest.mark.skip(reason="Transformer Engine not importable here: this runs in a venv with TE "
                                   "(../shared/te-cpu/install.sh, docs/te.md; CI's te stage)")
    for item in items:
        mark = item.get_closest_marker("te")
        if mark is not None and mark.kwargs.get("required", True):
            item.add_marker(skip)


def surface_refusals(prefix: str) -> tuple:
    """Why the installed upstream cannot take the patches named ``prefix``* (the reasons `megapatch
    doctor` shows as INCOMPATIBLE); empty where it can. The version matrix runs each patch's tests
    on every pinned version: where this is not empty they skip with it and the refusal is tested."""
    from megapatch.commands.doctor import _findable
    from megapatch.core import engine

    # a patch whose hook package is absent (megatron.rl, a Megatron-LM checkout's) has no verdict
    # here, as doctor says: it is checked where a job imports it; nor one whose package is absent
    # (megatron-core's TE wrappers without TE: stand-ins, nothing to wrap)
    return tuple(f"{p.name}: {reason}" for p in engine.patches()
                 if p.name.startswith(prefix) and _findable(p.hook_package) and _findable(p.package_module)
                 for reason in engine.check(p))


def skip_unless_upstream_takes(prefix: str, what: str) -> None:
    """Skip a test of ``what`` (e.g. "tp_invariant") where this upstream cannot take its patches."""
    refusals = surface_refusals(prefix)
    if refusals:
        pytest.skip(f"this megatron-core cannot take {what} (the refusal is tested instead): " + "; ".join(refusals))


def check_refused_where_upstream_cannot_take(prefix: str, what: str, **options) -> None:
    """Where this upstream cannot take ``what``, ``enable(**options)`` raises the first surface
    refusal and leaves megapatch off; elsewhere the test skips (the tests of the mode run)."""
    from megapatch.core.errors import UpstreamSurfaceError

    refusals = surface_refusals(prefix)
    if not refusals:
        pytest.skip(f"this megatron-core can take {what}: the tests of the mode run instead")
    with pytest.raises(UpstreamSurfaceError, match=re.escape(refusals[0].partition(": ")[2])):
        megapatch.enable(**options)
    assert not megapatch.is_enabled()


def environ_without_megapatch() -> dict:
    """A copy of this process's environment without any MEGAPATCH_* variable: what a child process
    is started with when a test sets its megapatch variables itself (or none)."""
    from megapatch.core.startup import ACTIVATED_ENV  # this process's, not the child's parent's

    return {k: v for k, v in os.environ.items() if not k.startswith("MEGAPATCH_") and k != ACTIVATED_ENV}


class StandInGroup:
    """A process group as megapatch's code reads it -- ``size()``, ``rank()`` -- without
    torch.distributed (in-process tests of the pieces; the rank jobs use real gloo groups)."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def bare_module(cls):
    """An instance of the torch Module subclass ``cls`` without running its ``__init__``: the type
    (isinstance checks) and the attributes a test sets are what is read; no process group, no weights."""
    import torch

    module = object.__new__(cls)
    torch.nn.Module.__init__(module)
    return module


def run_python(code: str, env: dict = None, timeout: int = 180, fresh: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c`` would (clean MEGAPATCH_* environment plus ``env``): in a fresh
    interpreter, or with ``fresh=False`` in a child of the rank server (torch and the third-party
    stack already imported, megatron and megapatch not; the MEGAPATCH_* start-up hook runs as at
    interpreter start): for what does not test interpreter start-up itself."""
    full_env = environ_without_megapatch()
    full_env["PYTHONWARNINGS"] = "ignore"
    full_env.update(env or {})
    if not fresh and sys.platform.startswith("linux"):
        from megapatch.testing.ranks import rank_server

        return rank_server.run_code(textwrap.dedent(code), env=full_env, cwd=REPO, timeout=timeout)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def pinned_megatron_lm(tmp_path_factory, name: str = "core_v0.16.1"):
    """The pinned Megatron-LM tarball ``name`` unpacked into a fresh temporary directory (from
    ``$MEGATRON_LM_TARBALLS`` or ``<repo>/../shared/megatron-lm``); skips, saying what is missing,
    where its training dependencies or the tarball are absent."""
    from pathlib import Path

    import pytest

    from megapatch.testing.ranks import megatron_lm_runs as mlm

    missing = mlm.missing_training_modules()
    if missing:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py needs {', '.join(missing)}: pip install '.[megatron-lm]'")
    tarball = Path(os.environ.get("MEGATRON_LM_TARBALLS", Path(REPO).parent / "shared" / "megatron-lm")) \
        / mlm.TARBALLS[name]
    if not tarball.is_file():
        pytest.skip(f"no pinned Megatron-LM sources: {tarball} is absent")
    return mlm.unpack(tarball, tmp_path_factory.mktemp(f"megatron-lm-{name}"))
