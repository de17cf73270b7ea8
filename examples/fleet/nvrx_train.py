"""The fleet training script under nvidia-resiliency-ext's fault tolerance (``ft_launcher``).

    ft_launcher --nproc-per-node 8 --max-restarts 3 --ft-rank-heartbeat-timeout 300 \\
        examples/fleet/nvrx_train.py --steps 1000

Two things join the two tools (docs/OPERATIONS.md, "nvidia-resiliency-ext"):

- Heartbeats. The rank monitor kills a rank whose heartbeats stop for longer than its
  timeout. sdc-guard's re-execution of a detected step (and a rollback's restore) makes
  that step last several times as long: ``Policy(heartbeat=client.send_heartbeat)`` beats
  before and after each re-execution and around the restore, so a replay is not taken
  for a hang. The loop beats once per step as usual.
- Exit codes. ft_launcher restarts the workers in place on any failure, then exits 1 when
  its restarts are spent (or 93, its own "do not requeue" verdict): sdc-guard's 16, 17, 18
  do not reach the scheduler through it. So the rank whose device is suspect (17, 18, 19:
  ``exit_codes`` entries that drain) asks the launcher to leave its node out of the next
  rendezvous (``WorkloadAction.ExcludeThisNode``) before it exits; a 16 needs nothing (an
  in-place restart is what it asks for). The exit report still tells the outer
  scheduler's script what to exclude.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nvidia_resiliency_ext.fault_tolerance as ft

import sdc_guard
from sdc_guard.respond.exit_codes import describe
from sdc_guard.respond.identity import local_identity

sys.path.insert(0, str(Path(__file__).parent))
from train import parse, train  # noqa: E402  (the same training as the other recipes)


def main() -> int:
    args = parse()
    client = ft.RankMonitorClient()
    client.init_workload_monitoring()
    try:
        policy = sdc_guard.Policy(on_detection=args.on_detection, heartbeat=client.send_heartbeat)
        return train(args, policy=policy, on_step=lambda step: client.send_heartbeat())
    except sdc_guard.SDCExit as exc:
        entry = describe(exc.code)
        me = local_identity().rank
        if entry is not None and entry.drain and me in set(exc.outcome.flagged_ranks) | set(exc.outcome.tripped_ranks):
            client.send_workload_control_request(ft.WorkloadControlRequest(
                ft.WorkloadAction.ExcludeThisNode,
                f"sdc-guard exit {exc.code} ({exc.outcome.classification}) at step {exc.outcome.step}"))
        raise
    finally:
        client.shutdown_workload_monitoring()


if __name__ == "__main__":
    raise SystemExit(main())
