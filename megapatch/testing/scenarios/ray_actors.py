"""Megatron ranks as Ray actors, as RL frameworks (verl, NeMo-RL, OpenRLHF) start them: megapatch
switched on only through each actor's ``runtime_env`` environment variables.

``python -m megapatch.testing.scenarios.ray_actors JOBS_JSON`` starts a local Ray cluster on CPU and,
per job, one actor per rank with ``runtime_env={"env_vars": {RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK, **job env}}`` (verl's ``RayWorkerGroup`` passes the same variables).
Each actor joins a gloo group, builds megatron-core's parallel state (TP = world size) and the tiny
GPT, and trains one step with megatron-core's BF16 optimizer. The driver never sets a
``MEGAPATCH_*`` variable and never imports megapatch's engine. It prints one ``RESULT <json>``
line: per job, each rank's outcome (status, logits dtype, loss, or the error text; ``died`` for
every rank of a job one of whose actors died). The actors' own output (the activation line)
reaches the driver's stderr through Ray's log forwarding.

``JOBS_JSON``: ``[{"name": ..., "env": [{VAR: VALUE} per rank]}, ...]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import timedelta
from typing import Any, Dict, List

WORLD = 2
GROUP_TIMEOUT_S = 120  # gloo's default is 30 minutes: a rank whose peer never came would outlive the test


class MegatronRank:
    """One rank. Imports torch and megatron only in ``train_step`` (as a worker's first call)."""

    def train_step(self) -> Dict[str, Any]:
        import torch
        import torch.distributed as dist

        from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.set_num_threads(1)
        try:  # env:// from runtime_env; a bounded wait, so a broken group is reported instead of hanging
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 -- the job never started; the driver runs it once more
            return {"rank": rank, "status": "no-group", "error": f"{type(exc).__name__}: {exc}"}
        try:
            with cpu_workarounds():  # labelled CPU stand-ins (megapatch.testing.stand_ins.cpu_compat)
                return self._step(rank, world)
        except Exception as exc:  # noqa: BLE001 -- reported to the driver as the rank's outcome
            return {"rank": rank, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _step(self, rank: int, world: int) -> Dict[str, Any]:
        from megatron.core import parallel_state

        import megapatch
        from megapatch.testing.models.tiny_gpt import (build_bf16_optimizer, build_tiny_gpt, cuda_type_names,
                                                        make_batch, tiny_gpt_config)

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model = build_tiny_gpt(tiny_gpt_config(tp=world), vocab_size=128, seq_len=16, seed=1234)
        optimizer = build_bf16_optimizer(model)
        batch = make_batch(seed=5, batch=2, seq_len=16, vocab=128)
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        loss.float().mean().backward()
        with cuda_type_names():
            ok, grad_norm, _ = optimizer.step()
        status = megapatch.status()
        return {"rank": rank, "status": "trained" if ok else "skipped-step", "logits_dtype": str(logits.dtype),
                "loss": float(loss.float().mean()), "grad_norm": float(grad_norm),
                "enabled": status.enabled, "active": list(status.active),
                "settings": {k: str(v) for k, v in status.settings.items()}, "pid": os.getpid()}


def _run_job(actor_class: Any, job: Dict[str, Any]) -> List[Dict[str, Any]]:
    import ray

    from megapatch.testing.ranks.ports import rendezvous_port

    port = rendezvous_port()
    actors = []
    for rank, extra in enumerate(job["env"]):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(job["env"])),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore", **extra}
        actors.append(actor_class.options(runtime_env={"env_vars": env}).remote())
    try:
        return ray.get([a.train_step.remote() for a in actors], timeout=2 * GROUP_TIMEOUT_S)
    except ray.exceptions.RayError as exc:  # an actor died (a crashed collective, say) or the job timed
        # out: this job's outcome, reported as such; the other jobs are still judged
        died = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        return [{"rank": rank, "status": "died", "error": died} for rank in range(len(actors))]
    finally:
        for actor in actors:
            ray.kill(actor)


def run(jobs: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    import ray

    ray.init(num_cpus=WORLD, include_dashboard=False, log_to_driver=True, object_store_memory=100 * 2 ** 20,
             _temp_dir=tempfile.mkdtemp(prefix="mp-ray-"), configure_logging=False)
    try:
        actor_class = ray.remote(num_cpus=0)(MegatronRank)
        results = {}
        for job in jobs:
            results[job["name"]] = outcome = _run_job(actor_class, job)
            if any(r["status"] == "no-group" for r in outcome):
                # another gloo job on the machine took the port, or a pair dialled a listener of
                # another job (pytest-xdist workers): nothing of the job ran, so run it once more
                print(f"ray_actors: job {job['name']!r}: the gloo group did not form ({outcome}); once more",
                      file=sys.stderr, flush=True)
                results[job["name"]] = _run_job(actor_class, job)
        return results
    finally:
        ray.shutdown()


def main() -> None:
    if any(k.startswith("MEGAPATCH_") for k in os.environ):
        sys.exit("ray_actors: the driver must not carry MEGAPATCH_* variables (only the actors' runtime_env)")
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
