"""Issue 28 item 3: one activation line per job, worker processes included.

A rank that activated from ``MEGAPATCH_*`` can start processes that import its ``__main__`` and so
megatron again: the torch_dist checkpoint writer's spawned ``Manager``
(``filesystem_async._get_write_results_queue``), spawned data-loader workers. They inherit the
rank's environment and ``RANK``, so each logged a second ``megapatch enabled`` line. Decided:
such a worker is patched like its rank (the same settings; it does no arithmetic megapatch
changes, as far as read) but stays quiet. A process started with multiprocessing by one that did
not activate (``torch.multiprocessing.spawn`` ranks) logs as any rank does.

Each test runs a real interpreter (the installed start-up hook) and a real ``spawn`` child.
"""

import subprocess
import sys
import textwrap

from conftest import REPO, environ_without_megapatch

SCRIPT = """
import multiprocessing, sys
{parent_import}

def child():
    import megatron.core  # noqa: F401 -- as a rank's worker does, through its __main__ or itself
    import megapatch
    s = megapatch.status()
    print("CHILD", s.enabled, s.settings["tp_reduce_dtype"], s.sources["tp_reduce_dtype"], flush=True)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join()
    sys.exit(process.exitcode)
"""


def _run(tmp_path, parent_import):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(parent_import=parent_import)))
    env = environ_without_megapatch()
    env.update(MEGAPATCH_TP_REDUCE_DTYPE="fp32", RANK="0", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_worker_of_an_activated_rank_is_patched_and_logs_nothing(tmp_path):
    result = _run(tmp_path, "import megatron.core  # the rank: activates and logs")
    assert result.stderr.count("megapatch enabled:") == 1, result.stderr
    assert "CHILD True fp32 env MEGAPATCH_TP_REDUCE_DTYPE" in result.stdout, result.stdout


def test_a_process_spawned_by_one_that_never_activated_logs_its_line(tmp_path):
    """``torch.multiprocessing.spawn``-style ranks: the parent never imported megatron."""
    result = _run(tmp_path, "")
    assert result.stderr.count("megapatch enabled:") == 1, result.stderr
    assert "CHILD True fp32 env MEGAPATCH_TP_REDUCE_DTYPE" in result.stdout, result.stdout
