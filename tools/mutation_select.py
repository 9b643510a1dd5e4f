"""Choose which mutants of a cosmic-ray session run (a work-db filter, like cosmic-ray's own).

    python tools/mutation_select.py SESSION sample N SEED
        keep a seeded random sample of N pending mutants; mark the rest skipped
    python tools/mutation_select.py SESSION survivors-of OLD_SESSION
        keep only the mutants that survived in OLD_SESSION (same source, so the same operator,
        occurrence and position); mark the rest skipped
    python tools/mutation_select.py SESSION lines RANGES
        keep only the pending mutants that start on a line in RANGES ("250-345,351-390,97": first
        and last line, inclusive); mark the rest skipped. Run it before ``sample`` to sample one
        region of a module (``MUTATION_LINES`` in ``tools/mutation.sh``)
    python tools/mutation_select.py SESSION summary [RANGES]
        one line: killed / run / total (with RANGES: also how many mutants start in those lines),
        then every mutant run: outcome, operator, line, diff

Run it with the interpreter cosmic-ray is installed in (``tools/mutation.sh`` does).
"""

from __future__ import annotations

import random
import sys

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult


def _key(item):
    (m,) = item.mutations
    return (m.operator_name, m.occurrence, tuple(m.start_pos), tuple(m.end_pos),
            tuple(sorted((k, repr(v)) for k, v in (m.operator_args or {}).items())))


def _skip(db, items, why):
    for item in items:
        db.set_result(item.job_id, WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED))


def _ranges(text: str):
    spans = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        spans.append((int(first), int(last or first)))
    return spans


def _in(item, spans) -> bool:
    (m,) = item.mutations
    return any(first <= m.start_pos[0] <= last for first, last in spans)


def lines(db, text: str) -> None:
    spans = _ranges(text)
    _skip(db, [item for item in db.pending_work_items if not _in(item, spans)], f"not in lines {text}")


def sample(db, n: int, seed: int) -> None:
    # job ids are random: order by mutation (position; ties keep cosmic-ray's deterministic init order)
    pending = sorted(db.pending_work_items, key=lambda item: _key(item)[:4])
    keep = set(random.Random(seed).sample(range(len(pending)), min(n, len(pending))))
    _skip(db, [item for i, item in enumerate(pending) if i not in keep], f"not in the seed-{seed} sample")


def survivors_of(db, old_path: str) -> None:
    with use_db(old_path, WorkDB.Mode.open) as old:
        survived = {_key(item) for item, result in old.completed_work_items
                    if result.worker_outcome == WorkerOutcome.NORMAL and not result.is_killed}
    _skip(db, [item for item in db.pending_work_items if _key(item) not in survived],
          "killed (or not run) in the earlier session")


def summary(db, text: str = "") -> None:
    done = [(item, result) for item, result in db.completed_work_items
            if result.worker_outcome != WorkerOutcome.SKIPPED]
    killed = [x for x in done if x[1].is_killed]
    region = ""
    if text:
        spans = _ranges(text)
        region = f" / in lines {text}: {sum(_in(item, spans) for item in db.work_items)}"
    print(f"{db.name() if callable(db.name) else db.name}: killed {len(killed)} / run {len(done)}{region}"
          f" / total {db.num_work_items}")
    for item, result in sorted(done, key=lambda x: _key(x[0])):
        (m,) = item.mutations
        if result.test_outcome == TestOutcome.SURVIVED:
            outcome = "SURVIVED"
        elif result.output == "timeout":
            outcome = "killed (timeout)"
        elif result.test_outcome == TestOutcome.INCOMPETENT:
            outcome = "killed (incompetent: the mutant does not run)"
        else:
            outcome = "killed"
        print(f"{outcome}: {m.operator_name} #{m.occurrence}, line {m.start_pos[0]}")
        print("    " + "\n    ".join(line for line in (result.diff or "").splitlines()
                                      if line[:1] in "+-" and line[:3] not in ("---", "+++")))


def main(argv) -> int:
    path, command, *rest = argv
    with use_db(path, WorkDB.Mode.open) as db:
        if command == "sample":
            sample(db, int(rest[0]), int(rest[1]))
        elif command == "survivors-of":
            survivors_of(db, rest[0])
        elif command == "lines":
            lines(db, rest[0])
        elif command == "summary":
            summary(db, *rest)
        else:
            raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
