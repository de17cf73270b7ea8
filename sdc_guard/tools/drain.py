"""``sdc-guard drain REPORT --scheduler slurm|kubernetes``: the scheduler commands an exit
report asks for.

The report (``sdc_guard-exit.json``, written by rank 0 at an ``exit`` response) says the
exit code, and for it (``respond.exit_codes.EXIT_CODES``) whether to requeue the job as it
is or to restart it elsewhere, and which nodes and devices to take out of service. This
prints the commands, one per line, shell-quoted (a dry run); ``--execute`` runs them, in
order, stopping at the first that fails. The recipes of docs/OPERATIONS.md call it from the
job's script once the training process has exited.

Slurm:

- requeue (16): ``scontrol requeue JOB``;
- exclude (17, 18, 19): with ``--drain-nodes`` (an administrator's right),
  ``scontrol update NodeName=N State=DRAIN Reason=...``; then, with ``--resubmit SCRIPT``,
  ``sbatch --exclude=NODES --export=ALL,SDC_GUARD_EXCLUDED=NODES SCRIPT``: a new job that
  avoids these nodes and those ``--excluded`` lists (the job's earlier exclusions, which
  the resubmitted job finds in ``$SDC_GUARD_EXCLUDED``). A running job's excluded nodes
  cannot be changed and a requeued job keeps its own, hence a new submission.

Kubernetes:

- requeue (16): nothing; the Job's ``podFailurePolicy`` starts a new pod (docs/OPERATIONS.md);
- exclude: ``kubectl cordon N``, ``kubectl label node N sdc-guard.io/suspect=exit-CODE`` and
  ``kubectl annotate node N sdc-guard.io/devices=UUIDS``, so that no pod lands there until
  a person (or a return-to-service job running ``sdc-guard selftest``) uncordons it.

Exit status: 0 (the commands were printed, or all ran), 1 (the report cannot be read, is
not one, or does not match ``--exit-code``, the status the job's process exited with: a
stale report from an earlier run must not drain a good node), 2 (bad arguments), or the
status of the first command that failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..respond.exit_codes import describe

SCHEDULERS = ("slurm", "kubernetes")
EXIT_BAD_REPORT = 1
EXIT_BAD_ARGS = 2
LABEL = "sdc-guard.io/suspect"
ANNOTATION = "sdc-guard.io/devices"


def read_report(path: str | Path) -> dict[str, Any]:
    """The exit report at ``path``; ``ValueError`` saying what is wrong with it."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the exit report {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("exit_code"), int):
        raise ValueError(f"{path} is not an sdc-guard exit report (no integer exit_code)")
    return report


def _nodes(report: dict[str, Any]) -> list[str]:
    nodes = report.get("exclude_nodes") or sorted({d["node"] for d in report.get("drain", []) if "node" in d})
    return [str(n) for n in nodes]


def _devices(report: dict[str, Any], node: str) -> list[str]:
    return sorted({str(d.get("device_id") or d.get("device")) for d in report.get("drain", []) if d.get("node") == node})


def _reason(report: dict[str, Any], node: str) -> str:
    ranks = sorted({d["rank"] for d in report.get("drain", []) if d.get("node") == node})
    return (f"sdc-guard exit {report['exit_code']} ({report.get('classification')}) at step {report.get('step')}: "
            f"ranks {','.join(map(str, ranks))} devices {','.join(_devices(report, node))}")


def slurm_commands(report: dict[str, Any], *, job_id: str | None, excluded: list[str], resubmit: str | None,
                   drain_nodes: bool) -> list[list[str]]:
    """The Slurm commands for ``report`` (see the module docstring)."""
    entry = describe(report["exit_code"])
    if entry is None:
        return []
    if entry.scheduler == "requeue":
        if not job_id:
            raise ValueError("--job-id: expected the job to requeue ($SLURM_JOB_ID), got none")
        return [["scontrol", "requeue", job_id]]
    nodes = _nodes(report)
    commands = [["scontrol", "update", f"NodeName={n}", "State=DRAIN", f"Reason={_reason(report, n)}"]
                for n in nodes] if drain_nodes else []
    if resubmit:
        avoid = ",".join(dict.fromkeys([*excluded, *nodes]))
        commands.append(["sbatch", f"--exclude={avoid}", f"--export=ALL,SDC_GUARD_EXCLUDED={avoid}", resubmit])
    return commands


def kubernetes_commands(report: dict[str, Any]) -> list[list[str]]:
    """The kubectl commands for ``report`` (see the module docstring)."""
    entry = describe(report["exit_code"])
    if entry is None or entry.scheduler == "requeue":
        return []
    commands = []
    for n in _nodes(report):
        commands.append(["kubectl", "cordon", n])
        commands.append(["kubectl", "label", "node", n, f"{LABEL}=exit-{report['exit_code']}", "--overwrite"])
        devices = _devices(report, n)
        if devices:
            commands.append(["kubectl", "annotate", "node", n, f"{ANNOTATION}={','.join(devices)}", "--overwrite"])
    return commands


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", help="the exit report (sdc_guard-exit.json)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, required=True)
    parser.add_argument("--exit-code", type=int, help="the exit status of the training process: the report must "
                                                      "say the same (a stale report must not drain a good node)")
    parser.add_argument("--job-id", help="Slurm: the job to requeue (default: none; the recipe passes $SLURM_JOB_ID)")
    parser.add_argument("--excluded", default="", help="Slurm: nodes the job already excludes, comma-separated")
    parser.add_argument("--resubmit", metavar="SCRIPT", help="Slurm: submit SCRIPT again, avoiding the nodes")
    parser.add_argument("--drain-nodes", action="store_true", help="Slurm: also drain the nodes (administrators)")
    parser.add_argument("--execute", action="store_true", help="run the commands (default: print them)")


def run(args: argparse.Namespace) -> int:
    try:
        report = read_report(args.report)
    except ValueError as exc:
        print(f"drain: {exc}", file=sys.stderr)
        return EXIT_BAD_REPORT
    if args.exit_code is not None and args.exit_code != report["exit_code"]:
        print(f"drain: the process exited with {args.exit_code}, the report {args.report} says "
              f"{report['exit_code']}: a stale report? nothing done", file=sys.stderr)
        return EXIT_BAD_REPORT
    try:
        if args.scheduler == "slurm":
            excluded = [n for n in args.excluded.split(",") if n]
            commands = slurm_commands(report, job_id=args.job_id, excluded=excluded, resubmit=args.resubmit,
                                      drain_nodes=args.drain_nodes)
        else:
            commands = kubernetes_commands(report)
    except ValueError as exc:
        print(f"drain: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    entry = describe(report["exit_code"])
    print(f"# sdc-guard exit {report['exit_code']}: "
          f"{entry.meaning if entry else 'not an sdc-guard exit code; nothing to do'}", file=sys.stderr)
    for command in commands:
        print(shlex.join(command), flush=True)
        if args.execute:
            done = subprocess.run(command)
            if done.returncode != 0:
                print(f"drain: {command[0]} exited with {done.returncode}; stopping", file=sys.stderr)
                return done.returncode
    return 0
