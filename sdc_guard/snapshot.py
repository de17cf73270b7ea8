"""Known-good state: in-memory snapshots and atomically written checkpoints.

A rollback is only as good as the state it returns to. A snapshot is *known-good* when no
unresolved detection happened between it and the previous good one: a detection whose
corrupted result never reached the model state (re-computed clean, skipped, rolled back)
does not count; one that was only logged does, and taints every later snapshot until a
rollback returns to good state. Snapshots are taken every ``every`` completed steps, in
host memory (on CUDA the copy to pinned host memory is asynchronous; it is waited for
only when the snapshot is used), and optionally written as checkpoints: temporary file,
fsync, rename, fsync of the directory, so a crash mid-write leaves the previous checkpoint
intact; loaded with ``weights_only=True``.

With a sampler that verifies only some GEMMs, corruption can go unseen for a while and a
snapshot taken in that while is "good" only as far as the guard could see.

Under ``torch.distributed`` every rank keeps its own snapshots in memory, but only global
rank 0 writes and prunes checkpoint files (as Lightning's ``ModelCheckpoint`` does): the
replicas of a data-parallel job hold the same state, so one file serves them all, and
``checkpoint_dir`` must be a folder every rank can read (a shared file system). A rank
that restores from a file first waits at a barrier for rank 0's writes; a rollback is
agreed in lockstep, so every rank gets there together.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from . import distributed


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: readers see the old file or the new one.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> p = save_checkpoint(f"{d}/a.pt", {"w": torch.ones(2)}); load_checkpoint(p)["w"].tolist()
    [1.0, 1.0]
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (``weights_only=True``, to CPU)."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def _to_host(obj: Any, pin: bool) -> Any:
    """Deep copy of a state dict with every tensor on the host (async from CUDA)."""
    if isinstance(obj, Tensor):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
        return host.copy_(obj.detach(), non_blocking=pin)
    if isinstance(obj, dict):
        return {k: _to_host(v, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v, pin) for v in obj)
    return obj


@dataclass
class Snapshot:
    """State of a run after ``step`` completed steps."""

    step: int
    state: dict[str, Any]  #: "model", "optimizer", and any extra stateful objects
    _ready: Any = field(default=None, repr=False)  #: CUDA event of the async host copy

    def wait(self) -> "Snapshot":
        """Block until the asynchronous host copy is complete."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self


CHECKPOINT_PATTERN = re.compile(r"^sdc_guard-step(-?\d+)\.pt$")  # -1: before the first step


class SnapshotStore:
    """Takes, keeps and restores known-good snapshots of a model (and optimizer, extras).

    >>> model = torch.nn.Linear(2, 2); store = SnapshotStore(model, every=1)
    >>> store.after_step(0) is not None
    True
    >>> with torch.no_grad(): _ = model.weight.add_(1)
    >>> store.restore().step
    0
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 50,
        keep: int = 2,
        checkpoint_dir: str | os.PathLike | None = None,
        extras: dict[str, Stateful] | None = None,
    ) -> None:
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.keep = keep
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.extras = dict(extras or {})
        self.snapshots: list[Snapshot] = []
        self.tainted = False

    def _stateful(self) -> dict[str, Stateful]:
        objs: dict[str, Stateful] = {"model": self.model}
        if self.optimizer is not None:
            objs["optimizer"] = self.optimizer
        objs.update(self.extras)
        return objs

    @property
    def last_good(self) -> Snapshot | None:
        """The newest known-good snapshot in memory."""
        return self.snapshots[-1] if self.snapshots else None

    def note_detection(self, *, resolved: bool) -> None:
        """A detection happened; unless its result never reached the state, taint."""
        if not resolved:
            self.tainted = True

    def take(self, step: int) -> Snapshot | None:
        """Snapshot now if the state is known-good (else ``None``)."""
        if self.tainted:
            return None
        pin = torch.cuda.is_available()
        state = {name: _to_host(obj.state_dict(), pin) for name, obj in self._stateful().items()}
        ready = None
        if pin and any(p.is_cuda for p in self.model.parameters()):
            ready = torch.cuda.Event()
            ready.record()
        snap = Snapshot(step, state, ready)
        self.snapshots = (self.snapshots + [snap])[-self.keep:]
        if self.checkpoint_dir is not None:
            self._write(snap)
        return snap

    def after_step(self, step: int) -> Snapshot | None:
        """Called after completed step ``step``: snapshot every ``every`` steps."""
        if step % self.every == 0 or not self.snapshots:
            return self.take(step)
        return None

    def _write(self, snap: Snapshot) -> None:
        assert self.checkpoint_dir is not None
        if distributed.rank() != 0:
            return  # one writer: the replicas' states are the same
        save_checkpoint(self.checkpoint_dir / f"sdc_guard-step{snap.step}.pt",
                        {"step": snap.step, **snap.wait().state})
        for old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)

    def checkpoints(self) -> list[Path]:
        """Known-good checkpoints on disk, oldest first."""
        if self.checkpoint_dir is None or not self.checkpoint_dir.exists():
            return []
        found = [(int(m.group(1)), p) for p in self.checkpoint_dir.iterdir()
                 if (m := CHECKPOINT_PATTERN.match(p.name))]
        return [p for _, p in sorted(found)]

    def restore(self, snapshot: Snapshot | None = None) -> Snapshot:
        """Load ``snapshot`` (default: the last good one in memory, else the newest
        checkpoint) into the model, optimizer and extras; clears the taint."""
        if snapshot is None:
            snapshot = self.last_good
        if snapshot is None:
            distributed.barrier()  # rank 0's last write is complete before anyone reads
            paths = self.checkpoints()
            if not paths:
                raise RuntimeError("rollback: no known-good snapshot or checkpoint to restore")
            state = load_checkpoint(paths[-1])
            snapshot = Snapshot(int(state.pop("step")), state)
        snapshot.wait()
        for name, obj in self._stateful().items():
            if name in snapshot.state:
                # a copy: Optimizer.load_state_dict keeps same-device tensors as they are,
                # and later in-place updates would otherwise write into the snapshot
                obj.load_state_dict(_to_host(snapshot.state[name], pin=False))
        self.tainted = False
        return snapshot
