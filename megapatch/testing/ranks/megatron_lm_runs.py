"""Drive Megatron-LM's ``pretrain_gpt.py`` under :mod:`megapatch.testing.ranks.cpu_launch` (tests, the
loss-table benchmark, a user's CI): find or unpack a checkout, build the flags of a tiny GPT, launch
``torchrun`` with ``MEGAPATCH_*`` variables only, and read back the losses Megatron-LM prints.

Nothing here imports torch or megatron: every run is a separate ``torchrun`` job.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

#: the pinned Megatron-LM sources (``<name>: tarball``), each unpacking to ``Megatron-LM/``
TARBALLS: Dict[str, str] = {
    "core_v0.16.1": "Megatron-LM-core_v0.16.1.tar.gz",
    "main-d98e8a64": "Megatron-LM-main-d98e8a64.tar.gz",
}
#: Megatron-LM revisions that need a newer Python than megatron-core does
MIN_PYTHON = {"main-d98e8a64": ((3, 12), "its megatron/training imports typing.override")}
#: what ``pretrain_gpt.py`` imports besides torch and megatron-core's own dependencies
#: (module names; pybind11 builds the dataset index helpers on first start)
TRAINING_MODULES = ("six", "einops", "regex", "sentencepiece", "tiktoken", "yaml", "pydantic",
                    "triton", "pybind11", "psutil")
USER_CHECKOUT_ENV = "MEGATRON_LM_DIR"

_LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.eE+-]+) \|")


def python_too_old(name: str) -> Optional[str]:
    """Why this interpreter cannot run revision ``name`` (None when it can)."""
    need = MIN_PYTHON.get(name)
    if need and sys.version_info[:2] < need[0]:
        return (f"Megatron-LM {name} needs Python >= {'.'.join(map(str, need[0]))} ({need[1]}); "
                f"this is Python {sys.version.split()[0]}")
    return None


def missing_training_modules() -> List[str]:
    import importlib.util

    return [m for m in TRAINING_MODULES if importlib.util.find_spec(m) is None]


def pinned_checkout(into: Path, name: str = "core_v0.16.1") -> Path:
    """The pinned tarball ``name`` from the project checkout's ``../shared/megatron-lm``, unpacked into
    ``into`` (the benchmarks' default where no ``--megatron-lm`` checkout is given)."""
    return unpack(Path(__file__).resolve().parents[3].parent / "shared" / "megatron-lm" / TARBALLS[name], into)


def unpack(tarball: Path, into: Path) -> Path:
    """Unpack a Megatron-LM source tarball into ``into``; returns the ``Megatron-LM`` checkout."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(into, **safe)
    checkout = into / "Megatron-LM"
    if not (checkout / "pretrain_gpt.py").is_file():
        raise FileNotFoundError(f"{tarball} did not unpack to a Megatron-LM/ checkout with pretrain_gpt.py")
    return checkout


def tiny_gpt_flags(*, tp: int = 1, pp: int = 1, layers_per_virtual_stage: Optional[int] = None,
                   sequence_parallel: bool = False, iters: int = 3, layers: int = 2,
                   hidden: int = 64, heads: int = 4, seq: int = 32, vocab: int = 128,
                   micro_batch: int = 2, global_batch: int = 4, lr: float = 1e-3,
                   seed: int = 1234, extra: Iterable[str] = ()) -> List[str]:
    """``pretrain_gpt.py`` flags for a tiny BF16 GPT on CPU ranks: mock data, no fused kernels,
    no dropout, no evaluation. Runs at different TP sizes see the same data and the same initial
    model (``--use-cpu-initialization`` splits one master weight) as long as the padded vocabulary
    is the same: ``vocab + 1`` (NullTokenizer's EOD) rounded up to 128 x TP."""
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq), "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(global_batch), "--train-iters", str(iters),
        "--lr", str(lr), "--min-lr", str(lr), "--lr-decay-style", "constant", "--seed", str(seed),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
        "--distributed-backend", "gloo", "--use-cpu-initialization", "--bf16",
        "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * iters + 1000),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
    ]
    if layers_per_virtual_stage is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_virtual_stage)]
    if sequence_parallel:
        flags.append("--sequence-parallel")
    return flags + list(extra)


@dataclasses.dataclass
class Run:
    command: List[str]
    returncode: int
    log: str  # stdout and stderr of every rank, as torchrun prints them
    seconds: float
    timed_out: bool = False

    @property
    def losses(self) -> Dict[int, str]:
        """``{iteration: "lm loss" as printed}`` (strings: compare them exactly, parse to compare)."""
        return {int(i): loss for i, loss in _LOSS_LINE.findall(self.log)}

    @property
    def active_patches(self) -> List[str]:
        """The patch names on the first ``... patches active: ...`` line (the patches line, rank 0; each
        patch's bracketed coverage note left out), then those of every ``megapatch installed later: a,
        b (<module> imported)`` line after it; empty when megapatch never enabled."""
        lines = self.log.splitlines()
        first = next((i for i, ln in enumerate(lines) if "patches active:" in ln), None)
        if first is None:
            return []
        names, depth, item = [], 0, ""
        for ch in lines[first].split("patches active:", 1)[1] + ",":
            depth += {"[": 1, "]": -1}.get(ch, 0)
            if depth == 0 and ch in ",;|":  # ';' and '|' end the list (pending imports, other fields)
                names.append(item.split("[")[0].strip())
                item = ""
                if ch != ",":
                    break
            else:
                item += ch
        for line in lines[first + 1:]:
            if "megapatch installed later:" in line:
                later = line.split("megapatch installed later:", 1)[1].split("(", 1)[0]
                names += [name.strip() for name in later.split(",") if name.strip() not in names]
        return [name for name in names if name]

    def tail(self, chars: int = 6000) -> str:
        return self.log[-chars:]


def launch_env(megapatch_env: Mapping[str, str], base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of a run: ``base`` (default: this process's) without any ``MEGAPATCH_*``,
    plus ``megapatch_env`` and what a GPU launch sets too (``CUDA_DEVICE_MAX_CONNECTIONS=1`` for
    TP > 1); ``python3``/``python3-config`` on PATH are this interpreter's (Megatron-LM's
    dataset-helper Makefile calls them)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("MEGAPATCH_")}
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    bindirs = [os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or ""]
    env["PATH"] = os.pathsep.join([d for d in bindirs if d] + [env.get("PATH", "")])
    env.update(megapatch_env)
    return env


def rank_server_env(start: Optional[str] = None) -> Dict[str, str]:
    """``{MPTEST_RANK_SERVER: socket}`` where a launch's processes should run as children of this
    process's rank server (:mod:`megapatch.testing.ranks.rank_server`: torch and the third-party
    stack already imported; the default on Linux), ``{}`` where they start as fresh interpreters
    (``start="spawn"`` or ``$MPTEST_RANKS_START=spawn``)."""
    from megapatch.testing.ranks import harness, rank_server

    return {rank_server.ENV: rank_server.address()} if harness.start_method(start) == "server" else {}


def launch(checkout: Path, flags: Sequence[str], *, nproc: int = 1,
           megapatch_env: Optional[Mapping[str, str]] = None,
           entry: Optional[Sequence[str]] = None, timeout: float = 600.0,
           extra_env: Optional[Mapping[str, str]] = None, script: str = "pretrain_gpt.py",
           start: Optional[str] = None) -> Run:
    """``torchrun --standalone --nproc-per-node N <entry> <script> <flags>`` from the checkout root.

    ``entry`` defaults to ``-m megapatch.testing.ranks.cpu_launch`` with this interpreter; a test may
    pass another (e.g. ``["--no-python", "sh", "wrapper.sh"]``). The whole process group is
    killed at ``timeout``. ``start``: each rank runs in a child of the rank server (``"server"``,
    the default on Linux: torchrun's worker forwards to it) or in torchrun's worker itself
    (``"spawn"``), as :func:`rank_server_env` says."""
    entry = list(entry) if entry is not None else ["-m", "megapatch.testing.ranks.cpu_launch"]
    server = rank_server_env(start)
    torchrun = "megapatch.testing.ranks.torchrun" if server else "torch.distributed.run"
    command = [sys.executable, "-m", torchrun, "--standalone",
               "--nproc-per-node", str(nproc), *entry, script, *flags]
    return launch_command(checkout, command, megapatch_env=megapatch_env, timeout=timeout,
                          extra_env={**server, **(extra_env or {})})


def launch_command(checkout: Path, command: Sequence[str], *,
                   megapatch_env: Optional[Mapping[str, str]] = None, timeout: float = 600.0,
                   extra_env: Optional[Mapping[str, str]] = None) -> Run:
    """Run ``command`` (e.g. ``megapatch-run ... torchrun ...``) from the checkout root in
    :func:`launch_env`'s environment; the whole process group is killed at ``timeout``."""
    env = launch_env(dict(megapatch_env or {}))
    env.update(extra_env or {})
    marker = env[LAUNCH_MARKER] = uuid.uuid4().hex
    command = list(command)
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=str(checkout), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks: List[str] = []
    reader = threading.Thread(target=lambda: chunks.append(process.stdout.read()), daemon=True)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(process.pid)
        process.wait()
    # what outlived the job still holds its output open: a process a rank started that no
    # launcher ended (Megatron RL's inference coordinator, when torchrun stopped its rank)
    _kill_marked(marker)
    reader.join(timeout=60)
    return Run(command, process.returncode, "".join(chunks), time.monotonic() - start, timed_out)


#: set to a fresh value in each launch's environment, which the processes it starts inherit
LAUNCH_MARKER = "MPTEST_LAUNCH"


def _kill_marked(marker: str, grace: float = 30.0) -> None:
    """SIGKILL every process of this user whose environment carries ``LAUNCH_MARKER=marker``, and
    wait (up to ``grace`` seconds) until each has exited: a killed process still holds its ports and
    files until the kernel has torn it down, and the next job may want them."""
    needle = f"{LAUNCH_MARKER}={marker}".encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
                    killed.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    deadline = time.monotonic() + grace
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if _running(pid)]
        if killed:
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has: only its parent's wait is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: Dict[int, List[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """Kill torchrun and its ranks: torchrun starts its workers in process groups of their own, so
    killing its group leaves a hung rank holding the log pipe open."""
    ranks = _descendants(pid)
    for target in [pid, *ranks]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def mean_abs_difference(a: Mapping[int, object], b: Mapping[int, object]) -> float:
    """Mean |loss_a - loss_b| over the keys both have (iterations as printed, or token indices)."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the runs have no iteration (or token) in common")
    return sum(abs(float(a[i]) - float(b[i])) for i in common) / len(common)
