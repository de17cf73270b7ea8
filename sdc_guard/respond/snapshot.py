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

Checkpoints belong to a *run*: ``sdc_guard-<run id>-step<N>.pt``. A directory is shared
by the runs that wrote into it (earlier jobs, restarts, one store per optimizer), and
each run answers only for its own files:

- pruning keeps a run's ``keep`` most recently written readable checkpoints and deletes
  only that run's older ones; other runs' files are never deleted (they may be another
  live job's, or the only copy of a state someone wants); step numbers do not order
  files (a run resumed at an earlier step writes lower numbers);
- ``restore()`` without an in-memory snapshot loads this run's newest readable
  checkpoint; a run with none of its own (a restart under a new run id) loads the most
  recently written readable checkpoint of any run;
- a file named like a checkpoint that is empty or not a complete torch archive (a
  foreign file, a copy cut short) is skipped with a warning, never counted against
  ``keep`` and never deleted;
- temporary files left by writers that were killed mid-write (``.<name>.tmp-<host>-<pid>``)
  are removed when a store opens the directory and after each write: at once when the
  writer's process is gone, otherwise only once they are older than the run (a live
  writer keeps its file fresh; one on another host is judged by age alone).

A directory that cannot be written is an error when the store is made. A disk that fails
later (permissions changed, disk full, a write cut short) is a monitoring failure: one
warning, and the run goes on with in-memory snapshots only; it never raises out of a
step whose optimizer update already happened.

With a sampler that verifies only some GEMMs, corruption can go unseen for a while and a
snapshot taken in that while is "good" only as far as the guard could see.

Under ``torch.distributed`` every rank keeps its own snapshots in memory, but only global
rank 0 writes and prunes checkpoint files (as Lightning's ``ModelCheckpoint`` does): the
replicas of a data-parallel job hold the same state, so one file serves them all, and
``checkpoint_dir`` must be a folder every rank can read (a shared file system). A rank
that restores from a file first waits at a barrier for rank 0's writes; a rollback is
agreed in lockstep, so every rank gets there together.

Sharded state (a model with DTensor parameters: FSDP2, tensor parallelism) is not one
rank's to write: its checkpoints are directories, ``sdc_guard-<run id>-step<N>.dcp``,
which every rank writes and reads together through ``torch.distributed.checkpoint``
(``sdc_guard.respond.sharded_checkpoint``). Everything above holds for them, with these
rules so that ranks never disagree:

- the run id (and the temporary name) is rank 0's, broadcast when the store is made;
- writing, reading from disk and deciding whether an initial snapshot is needed are
  collectives: every rank's store does them at the same step, as the guard's lockstep
  responses already do;
- what exists on disk is what rank 0 lists, broadcast; rank 0 alone prunes;
- a write or read that fails on any rank fails on all, agreed before anyone acts: a
  failed write turns writing off on every rank with the same warning, a failed read
  skips that checkpoint on every rank.

A store lists and loads only checkpoints of its own kind: files for plain state,
directories for sharded state.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from . import distributed
from . import sharded_checkpoint
from .checkpoint_io import (  # noqa: F401  (public names of this module since before the split)
    CHECKPOINT_PATTERN,
    RUN_ID_PATTERN,
    STALE_TEMPORARY_SECONDS,
    TEMPORARY_PATTERN,
    check_checkpoint_dir,
    describe_os_error,
    host_label,
    load_checkpoint,
    looks_complete,
    new_run_id,
    remove_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    writer_label,
)

log = logging.getLogger("sdc_guard")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


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
    #: ``"plain"``: ``state_dict()`` of each object; ``"dcp"``: read from a sharded
    #: checkpoint, the model's and optimizer's state keyed by name (``get_model_state_dict``)
    layout: str = "plain"

    def wait(self) -> "Snapshot":
        """Block until the asynchronous host copy is complete."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self


class SnapshotStore:
    """Takes, keeps and restores known-good snapshots of a model (and optimizer, extras).

    ``checkpoint_dir`` also writes each snapshot there (see the module docstring for
    how runs share a directory); ``run_id`` names this run's files (default: a fresh id
    per store; pass a stable one, such as the scheduler's job id, so that the restarts
    of one job are one run: a restart then restores and prunes that run's files).

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
        run_id: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__} {model!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.extras = _check_extras(extras)
        if run_id is not None and (not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id)):
            raise ValueError(f"run_id: expected 1-64 letters, digits, '_' or '.', got {run_id!r}")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.keep = keep
        self.run_id = run_id if run_id is not None else new_run_id()
        self.started = time.time()
        self.checkpoint_dir = check_checkpoint_dir(checkpoint_dir) if checkpoint_dir is not None else None
        self.disk_error: str | None = None  #: why checkpoints stopped being written, if they did
        self.snapshots: list[Snapshot] = []
        self.tainted = False
        self._written: list[Path] = []  #: checkpoints this store wrote, oldest first
        self._unloadable: set[Path] = set()  #: complete-looking archives that failed to load
        self._warned: set[str] = set()
        self._writer = writer_label()  #: the tail of temporary names (rank 0's, for sharded state)
        self._agreed = False
        if self.checkpoint_dir is not None:
            remove_stale_temporaries(self.checkpoint_dir, self.started)
            if self.sharded:
                self._agree_names()

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

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are directories every rank writes (DTensor state) rather
        than files rank 0 writes."""
        return sharded_checkpoint.is_sharded(self.model)

    def _agree_names(self) -> None:
        """Take rank 0's run id and writer label (a collective, once): the ranks of a
        sharded write must name one directory."""
        if not self._agreed:
            self.run_id, self._writer = distributed.broadcast_object((self.run_id, self._writer))
            self._agreed = True

    @property
    def writing(self) -> bool:
        """Whether snapshots are written as checkpoints (a directory, and no disk failure)."""
        return self.checkpoint_dir is not None and self.disk_error is None

    def note_detection(self, *, resolved: bool) -> None:
        """A detection happened; unless its result never reached the state, taint."""
        if not resolved:
            self.tainted = True

    def take(self, step: int) -> Snapshot | None:
        """Snapshot now if the state is known-good (else ``None``).

        Writing the checkpoint never raises: a disk that fails warns once and the run
        continues with in-memory snapshots (``disk_error`` says why).
        """
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
        if self.writing:
            try:
                self._write(snap)
            except Exception as exc:  # the optimizer has stepped: never raise from here
                self._disk_failed(exc)
        return snap

    def take_initial(self, step: int) -> Snapshot | None:
        """Snapshot the state before the first guarded step (``step``) unless a snapshot
        is in memory or this run has a checkpoint on disk. For sharded state, whether it
        has one is rank 0's answer, broadcast: the snapshot's write is a collective."""
        if self.last_good is not None:
            return None
        if self.checkpoint_dir is not None and self.sharded:
            self._agree_names()
            exists = distributed.broadcast_object(bool(self.checkpoints()) if distributed.rank() == 0 else None)
        else:
            exists = bool(self.checkpoints())
        return None if exists else self.take(step)

    def after_step(self, step: int) -> Snapshot | None:
        """Called after completed step ``step``: snapshot every ``every`` steps."""
        if step % self.every == 0 or not self.snapshots:
            return self.take(step)
        return None

    def checkpoint_path(self, step: int) -> Path:
        """Where this run's checkpoint of ``step`` goes."""
        if self.checkpoint_dir is None:
            raise RuntimeError("checkpoint_path(): this store has no checkpoint_dir")
        return self.checkpoint_dir / f"sdc_guard-{self.run_id}-step{step}.{self._kind}"

    @property
    def _kind(self) -> str:
        return "dcp" if self.sharded else "pt"

    def _write(self, snap: Snapshot) -> None:
        if self.sharded:
            self._write_sharded(snap)
            return
        if distributed.rank() != 0:
            return  # one writer: the replicas' states are the same
        path = save_checkpoint(self.checkpoint_path(snap.step), {"step": snap.step, **snap.wait().state})
        self._unloadable.discard(path)
        self._written = [p for p in self._written if p != path] + [path]
        for old in self.checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
        self._written = [p for p in self._written if p.exists()]
        remove_stale_temporaries(path.parent, self.started)

    def _write_sharded(self, snap: Snapshot) -> None:
        """Every rank writes its shards (a collective); rank 0 prunes once it is in place."""
        self._agree_names()
        path = self.checkpoint_path(snap.step)

        def on_commit() -> None:  # rank 0, after the rename
            self._unloadable.discard(path)  # a new checkpoint under a name that failed to load
            self._written = [p for p in self._written if p != path] + [path]
            for old in self.checkpoints()[: -self.keep]:
                remove_checkpoint(old, self._writer)
            self._written = [p for p in self._written if p.exists()]
            remove_stale_temporaries(path.parent, self.started)

        sharded_checkpoint.write(path, self._writer, snap.step, self.model, self.optimizer, self.extras,
                                 on_commit)
        self._unloadable.discard(path)

    def _disk_failed(self, exc: BaseException) -> None:
        # a sharded write's error is already in words, and the same on every rank
        agreed = isinstance(exc, sharded_checkpoint.ShardedCheckpointError)
        self.disk_error = str(exc) if agreed else describe_os_error(exc)
        message = (f"sdc_guard: cannot write checkpoints to {self.checkpoint_dir}: {self.disk_error}; "
                   "known-good snapshots are kept in memory only for the rest of this run")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _warn_unreadable(self, path: Path, why: str) -> None:
        if str(path) not in self._warned:
            self._warned.add(str(path))
            message = f"sdc_guard: skipping checkpoint {path}: {why}"
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def checkpoints(self, *, all_runs: bool = False) -> list[Path]:
        """This run's readable checkpoints on disk (``all_runs``: every run's), oldest
        written first. Files that are empty or not complete archives are left out, with
        a warning (once per file), and so are archives that ``restore()`` failed to load.
        Only checkpoints of this store's kind are listed: ``.pt`` files for plain state,
        ``.dcp`` directories for sharded state (this rank's view of the directory)."""
        if self.checkpoint_dir is None:
            return []
        try:
            names = os.listdir(self.checkpoint_dir)
        except OSError:
            return []
        order = {p: i for i, p in enumerate(self._written)}
        found = []
        kind = self._kind
        for name in names:
            match = CHECKPOINT_PATTERN.match(name)
            if match is None or match["kind"] != kind or (not all_runs and match["run"] != self.run_id):
                continue
            path = self.checkpoint_dir / name
            if path in self._unloadable:
                continue
            if not looks_complete(path):
                self._warn_unreadable(path, "not a complete checkpoint directory (no manifest, or a file "
                                            "missing or cut short)" if kind == "dcp" else
                                      "empty or not a complete checkpoint archive")
                continue
            if path in order:  # written by this store: newer than anything else of its run
                key: tuple = (1, order[path], 0)
            else:
                try:
                    key = (0, path.stat().st_mtime_ns, int(match["step"]))
                except OSError:
                    continue
            found.append((key, path))
        return [p for _, p in sorted(found)]

    def _load_newest(self) -> Snapshot:
        """The newest checkpoint that loads: this run's, else (none of this run's loads,
        or a restart under a new run id) the most recently written one of any run."""
        tried: set[Path] = set()
        for all_runs in (False, True):
            for path in reversed(self.checkpoints(all_runs=all_runs)):
                if path in tried:
                    continue
                tried.add(path)
                try:
                    state = load_checkpoint(path)
                    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
                        raise ValueError("it holds no model state")
                    step = state.pop("step")
                    if isinstance(step, bool) or not isinstance(step, int):
                        raise ValueError(f"its step is {step!r}")
                except Exception as exc:
                    self._unloadable.add(path)
                    self._warn_unreadable(path, f"{type(exc).__name__}: {exc}")
                    continue
                return Snapshot(step, state)
        raise RuntimeError("rollback: no known-good snapshot or readable checkpoint to restore")

    def _load_newest_sharded(self) -> Snapshot:
        """``_load_newest`` for checkpoint directories, a collective: rank 0's lists of
        candidates, each read by every rank; one that any rank cannot read is skipped
        by all (each rank warns with the agreed reason)."""
        self._agree_names()
        tried: set[str] = set()
        for all_runs in (False, True):
            names = None
            if distributed.rank() == 0:
                names = [p.name for p in reversed(self.checkpoints(all_runs=all_runs)) if p.name not in tried]
            for name in distributed.broadcast_object(names):
                tried.add(name)
                path = self.checkpoint_dir / name
                try:
                    step, state = sharded_checkpoint.read(path, self.model, self.optimizer, self.extras)
                except sharded_checkpoint.ShardedCheckpointError as exc:
                    self._unloadable.add(path)
                    self._warn_unreadable(path, str(exc))
                    continue
                return Snapshot(step, state, layout="dcp")
        raise RuntimeError("rollback: no known-good snapshot or readable checkpoint to restore")

    def restore(self, snapshot: Snapshot | None = None) -> Snapshot:
        """Load ``snapshot`` (default: the last good one in memory, else this run's newest
        readable checkpoint, else, after a restart, the newest readable one of any run)
        into the model, optimizer and extras; clears the taint. For sharded state,
        restoring from disk is a collective: every rank calls it at the same point (the
        guard's rollback does)."""
        if snapshot is None:
            snapshot = self.last_good
        if snapshot is None and self.checkpoint_dir is not None and self.sharded:
            snapshot = self._load_newest_sharded()
        if snapshot is None:
            distributed.barrier()  # rank 0's last write is complete before anyone reads
            snapshot = self._load_newest()
        snapshot.wait()
        if snapshot.layout == "dcp":
            sharded_checkpoint.apply(self.model, self.optimizer, self.extras, snapshot.state)
            self.tainted = False
            return snapshot
        for name, obj in self._stateful().items():
            if name in snapshot.state:
                # a copy: Optimizer.load_state_dict keeps same-device tensors as they are,
                # and later in-place updates would otherwise write into the snapshot
                obj.load_state_dict(_to_host(snapshot.state[name], pin=False))
        self.tainted = False
        return snapshot


def _check_extras(extras: Any) -> dict[str, Stateful]:
    if extras is None:
        return {}
    if not isinstance(extras, dict):
        raise TypeError(f"extras: expected a dict of name -> object with state_dict/load_state_dict, "
                        f"got {type(extras).__name__}")
    for key, obj in extras.items():
        if not isinstance(key, str) or key in ("model", "optimizer", "step"):
            raise ValueError(f"extras: expected names other than 'model', 'optimizer' and 'step', got {key!r}")
        if isinstance(obj, type) or not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"extras[{key!r}]: expected an object with state_dict() and load_state_dict(), "
                            f"got {type(obj).__name__}")
    return dict(extras)
