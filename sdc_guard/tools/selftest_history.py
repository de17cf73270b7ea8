"""The per-host record of ``sdc-guard selftest`` runs, and the score read from it.

Where it lives is the user's choice, ``--history FILE``: one JSON line per run, appended
with a single write (so several hosts can share one file on a local or cluster file
system whose appends are atomic, or each keep its own: a node-local path such as
``/var/lib/sdc-guard/selftest.jsonl`` survives jobs and follows the node, which is what a
return-to-service decision is about). Each line names its host (``identity.node_name``),
so a shared file scores each host apart.

The score of a host over its last ``window`` runs: how many ran and passed, the pass
rate, and ``consecutive_passes`` (runs since its last failure, this one included): the
figure a return-to-service rule reads (``--require-passes N``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: runs a score looks back over
DEFAULT_WINDOW = 20


def append(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (its folder created if missing)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, allow_nan=False) + "\n").encode()
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {target}")
    finally:
        os.close(fd)


def runs_of(path: str | os.PathLike, host: str) -> list[dict[str, Any]]:
    """The recorded runs of ``host`` in ``path``, oldest first (none if it does not exist;
    lines that are not a run record, such as half a line of a crashed writer, are skipped)."""
    target = Path(path)
    if not target.exists():
        return []
    runs = []
    for line in target.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("host") == host and isinstance(record.get("passed"), bool):
            runs.append(record)
    return runs


def score(runs: list[dict[str, Any]], host: str, window: int = DEFAULT_WINDOW) -> dict[str, Any]:
    """The score of ``host`` from its ``runs`` (oldest first), over the last ``window``.

    >>> r = [{"passed": p, "time": t} for t, p in enumerate([True, False, True, True])]
    >>> s = score(r, "n1"); s["runs"], s["passed"], s["consecutive_passes"], s["last_failure"]
    (4, 3, 2, 1)
    """
    recent = runs[-window:]
    passed = sum(1 for r in recent if r["passed"])
    streak = 0
    for r in reversed(runs):
        if not r["passed"]:
            break
        streak += 1
    failures = [r.get("time") for r in runs if not r["passed"]]
    return {"host": host, "window": window, "runs": len(recent), "passed": passed,
            "failed": len(recent) - passed, "pass_rate": passed / len(recent) if recent else None,
            "consecutive_passes": streak, "last_failure": failures[-1] if failures else None}
