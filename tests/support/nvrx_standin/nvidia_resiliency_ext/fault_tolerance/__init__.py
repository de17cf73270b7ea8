"""The client half of nvidia-resiliency-ext's fault tolerance, as its API documents it:

- ``RankMonitorClient()``; ``init_workload_monitoring()`` connects to the rank monitor
  (here: nothing to connect to); ``send_heartbeat()`` tells it the rank is alive;
  ``send_workload_control_request(req)`` asks the launcher for an action before the next
  rendezvous; ``shutdown_workload_monitoring()`` disconnects. Calls before
  ``init_workload_monitoring`` raise, as the real client's do.
- ``WorkloadAction``: ``Continue`` (0), ``ExcludeThisNode`` (1), ``ShutdownWorkload`` (2).
- ``WorkloadControlRequest(action, description="<not set>")``.

Each call is appended as a JSON line to ``$NVRX_STANDIN_LOG``.
"""

from __future__ import annotations

import json
import os
import time
from enum import Enum


class WorkloadAction(Enum):
    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2


class WorkloadControlRequest:
    def __init__(self, action: WorkloadAction, description: str = "<not set>") -> None:
        self.action = action
        self.description = description


class RankMonitorClientError(Exception):
    pass


def _record(call: str, **fields: object) -> None:
    with open(os.environ["NVRX_STANDIN_LOG"], "a") as log:
        log.write(json.dumps({"call": call, "time": time.monotonic(), **fields}) + "\n")


class RankMonitorClient:
    def __init__(self) -> None:
        self.is_initialized = False

    def _ensure_is_ready(self) -> None:
        if not self.is_initialized:
            raise RankMonitorClientError("RankMonitorClient is not initialized")

    def init_workload_monitoring(self) -> None:
        self.is_initialized = True
        _record("init_workload_monitoring")

    def send_heartbeat(self) -> None:
        self._ensure_is_ready()
        _record("send_heartbeat")

    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        self._ensure_is_ready()
        if not isinstance(req, WorkloadControlRequest):
            raise TypeError(f"req: expected a WorkloadControlRequest, got {type(req).__name__}")
        _record("send_workload_control_request", action=req.action.name, description=req.description)

    def shutdown_workload_monitoring(self) -> None:
        if self.is_initialized:
            self.is_initialized = False
            _record("shutdown_workload_monitoring")
