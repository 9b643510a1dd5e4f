"""Installing megapatch into stacks users already run (issue 10, items 1 and 2).

* A container-like venv: a pre-release torch (``2.8.0a0+nv25.5``, as NGC builds are versioned; a
  stand-in distribution is enough for the installer), megapatch's own small dependencies, no
  megatron-core distribution, a Megatron-LM checkout on ``PYTHONPATH``. Installing the megapatch
  wheel offline installs nothing else, and megapatch reports the versions of the modules in use.
* ``megapatch doctor`` with a Megatron-LM checkout on ``PYTHONPATH`` reports the checkout's
  megatron-core, not the version of the megatron-core wheel installed beside it.
* ``pip install --target DIR`` + ``PYTHONPATH=DIR``: no ``.pth`` is read there, and ``megapatch-run``
  (or ``python -m megapatch.commands.launcher``) still activates megapatch in the command's Python processes.

Needs the build backend (hatchling, fetched by pip's build isolation) to build the wheel, and the
Megatron-LM tarballs in ``$MEGATRON_LM_TARBALLS`` or ``<repo>/../shared/megatron-lm/`` for the checkout (as
tests/conftest.py reads them); skips, saying which,
when either is missing.
"""

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import zipfile

import pytest

from conftest import REPO

FAKE_TORCH = "2.8.0a0+nv25.5"
TARBALLS = os.environ.get("MEGATRON_LM_TARBALLS", os.path.join(os.path.dirname(REPO), "shared", "megatron-lm"))
pytestmark = pytest.mark.slow


_EMPTY = None


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGAPATCH_", "PIP_"))}
    env.pop("PYTHONPATH", None)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


def _run(cmd, env=None, timeout=300, check=True):
    """Run ``cmd`` in an empty directory (from the repository, ``python -c`` would import its
    megapatch: the current directory comes first on sys.path)."""
    global _EMPTY
    _EMPTY = _EMPTY or tempfile.mkdtemp(prefix="megapatch-test-cwd-")
    result = subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout,
                            cwd=_EMPTY)
    if check:
        assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _pip(python, *args, check=True):
    """This environment's pip, acting on ``python``'s environment (which needs no pip of its own)."""
    return _run([sys.executable, "-m", "pip", "--python", python, *args], check=check)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), REPO],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.skip(f"cannot build the megapatch wheel here (needs the hatchling build backend): "
                    f"{result.stderr.strip()[-500:]}")
    return glob.glob(str(out / "megapatch-*.whl"))[0]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """megatron/core of Megatron-LM main, extracted from the shared tarball."""
    found = sorted(glob.glob(os.path.join(TARBALLS, "Megatron-LM-main-*.tar.gz")))
    if not found:
        pytest.skip(f"no Megatron-LM main tarball in {TARBALLS}")
    root = tmp_path_factory.mktemp("megatron-lm")
    with tarfile.open(found[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("Megatron-LM/megatron/core/")]
        tar.extractall(root, members=members)
    path = root / "Megatron-LM"
    info = (path / "megatron" / "core" / "package_info.py").read_text()
    namespace = {"__file__": str(path / "megatron" / "core" / "package_info.py")}
    exec(info, namespace)  # noqa: S102 -- upstream constants
    return str(path), namespace["__version__"]


def _fake_torch_wheel(directory):
    """A wheel of a distribution named torch, version FAKE_TORCH, with a minimal torch package."""
    name = f"torch-{FAKE_TORCH}-py3-none-any.whl"
    info = f"torch-{FAKE_TORCH}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {FAKE_TORCH!r}\n",
        "torch/version.py": f"__version__ = {FAKE_TORCH!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {FAKE_TORCH}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: megapatch-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    path = os.path.join(directory, name)
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def _copy_distribution(name, site_packages):
    """Install ``name`` into another venv by copying its files from this environment."""
    dist = importlib.metadata.distribution(name)
    for file in dist.files:
        source = str(dist.locate_file(file))
        target = os.path.join(site_packages, str(file))
        if os.path.isfile(source) and not os.path.relpath(target, site_packages).startswith(".."):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)


def _version():
    with open(os.path.join(REPO, "megapatch", "core", "version.py")) as f:
        return next(line.split('"')[1] for line in f if line.startswith("__version__"))


def _venv(path):
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = str(path / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    return python, site


def _installed(python):
    listed = json.loads(_pip(python, "list", "--format=json").stdout)
    return {f"{d['name'].lower()}=={d['version']}" for d in listed}


@pytest.fixture(scope="module")
def container(tmp_path_factory, wheel):
    """``(python, installed before, installed after, pip's output)`` of the megapatch install."""
    path = tmp_path_factory.mktemp("container")
    python, site = _venv(path / "venv")
    _pip(python, "install", "--no-index", "--no-deps", _fake_torch_wheel(str(path)))
    for dependency in ("wrapt", "packaging"):  # megapatch's own, already there as in a container
        _copy_distribution(dependency, site)
    before = _installed(python)
    install = _pip(python, "install", "--no-index", wheel, check=False)
    return python, before, _installed(python), install


def test_installs_nothing_else_into_a_container_like_venv(container):
    _python, before, after, install = container
    assert f"torch=={FAKE_TORCH}" in before and not any(p.startswith("megatron") for p in before)
    assert install.returncode == 0, install.stderr[-3000:]  # offline: nothing else to fetch
    assert after - before == {f"megapatch=={_version()}"}, sorted(after ^ before)
    assert before - after == set()  # the user's torch untouched


def test_versions_are_those_of_the_modules_in_use(container, checkout):
    python, _before, _after, install = container
    assert install.returncode == 0, install.stderr[-3000:]
    checkout_path, checkout_version = checkout
    code = ("import json, megapatch.core.upstream_versions as v; "
            "print(json.dumps({p: v.version_info(p) for p in ('torch', 'megatron-core')}))")
    found = json.loads(_run([python, "-c", code], {"PYTHONPATH": checkout_path}).stdout)
    assert found["torch"][0] == FAKE_TORCH
    assert found["megatron-core"][0] == checkout_version, found
    assert checkout_path in found["megatron-core"][1]  # read from the checkout's package_info.py


def test_doctor_reports_the_megatron_core_of_the_checkout(checkout):
    checkout_path, checkout_version = checkout
    wheel_version = importlib.metadata.version("megatron-core")
    assert checkout_version != wheel_version, "the checkout must differ from the installed wheel"
    # this repository's megapatch (the one installed here, or a copy under test), then the checkout
    path = os.pathsep.join([checkout_path, REPO])
    result = _run([sys.executable, "-m", "megapatch", "doctor", "--json"], {"PYTHONPATH": path}, check=False)
    report = json.loads(result.stdout)
    assert report["versions"]["megatron-core"] == checkout_version, report["versions"]
    assert report["versions"]["torch"] == importlib.metadata.version("torch")


def _target_env(tmp_path, wheel):
    """A ``pip install --target`` dir T and a Python that reads no .pth of megapatch: this
    environment's site-packages reach it as a plain path entry (whose .pth files Python skips)."""
    target = tmp_path / "target"
    _pip(sys.executable, "install", "--no-index", "--no-deps", "--target", str(target), wheel)
    assert (target / "megapatch-startup.pth").exists()  # shipped, but never read from here
    python, site = _venv(tmp_path / "plain")
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return str(target), python


CHILD = textwrap.dedent("""
    import megatron.core, megapatch
    s = megapatch.status()
    print("FROM", megapatch.__file__)
    print("ENABLED", s.enabled, "ACTIVE", ",".join(s.active))
""")


def test_target_install_activates_through_the_launcher(tmp_path, wheel):
    target, python = _target_env(tmp_path, wheel)
    env = {"PYTHONPATH": target}
    # what a --target user gets today from the variable alone: nothing (no .pth is read there)
    plain = _run([python, "-c", CHILD], {**env, "MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert "ENABLED False" in plain.stdout and plain.stdout.split()[1].startswith(target)

    launcher = os.path.join(target, "bin", "megapatch-run")
    shell = f'"{python}" -c \'{CHILD}\''  # a non-Python process in between, as torchrun or srun
    for prefix in ([python, launcher], [python, "-m", "megapatch.commands.launcher"]):
        result = _run(prefix + ["--tp-reduce-dtype", "fp32", "--", "sh", "-c", shell], env)
        assert result.stdout.split()[1].startswith(target), result.stdout
        assert "ENABLED True" in result.stdout, result.stdout + result.stderr[-2000:]
        assert "tp_reduce.megatron_core" in result.stdout
