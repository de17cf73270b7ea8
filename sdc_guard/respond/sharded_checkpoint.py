"""Checkpoints of sharded state: one directory per snapshot, written by every rank (DCP).

A model sharded with FSDP2 (``fully_shard``) or tensor parallelism holds DTensor
parameters: each rank owns only its shards, so no one rank's file is the model. Such
state is written with ``torch.distributed.checkpoint`` (DCP), as torchtitan does: every
rank writes its own shards, and the optimizer's state is keyed by parameter name
(``get_optimizer_state_dict``), not by the position of a parameter in one rank's
optimizer. ``sdc_guard-<run>-step<N>.dcp/`` holds:

- DCP's files: ``__<rank>_<i>.distcp`` (each rank's shards; a replicated tensor is
  written once) and ``.metadata`` (rank 0, when every rank's data is written);
- ``rank<r>.pt``: rank r's extras (each rank's own objects, as its in-memory snapshot
  keeps them) and, while the optimizer has no state yet, its plain state dict: asking
  torch for the name-keyed state of such an optimizer would run a step with zero
  gradients to create it, which changes the optimizer (Adam's step count);
- ``sdc_guard.json``: the manifest, written last by rank 0 (``checkpoint_io``).

**Atomic.** Every rank writes into a temporary directory named with rank 0's host and
process id (``.sdc_guard-<run>-step<N>.dcp.tmp-<host>-<pid>``); after every rank's part
is known to be written, rank 0 writes the manifest, fsyncs, renames the directory into
place and fsyncs the parent. A crash mid-write leaves the previous checkpoints as they
were and a temporary directory that the next store to open the folder removes.

**Agreed.** Whether a write or a read succeeded is agreed by all ranks before anyone
acts on it (``distributed.gather_errors`` after each phase: the ranks' own files, DCP's
save or load, rank 0's rename): a write that fails on one rank fails on every rank, with
the same message naming the rank and the cause, so that every rank turns checkpoint
writing off together and no rank believes in a checkpoint another rank did not write.
What exists on disk is what rank 0 sees (the caller broadcasts rank 0's listing). A read
goes into copies of the state and is applied only when every rank has read its part.

**Trusted data.** DCP unpickles its ``.metadata`` and the non-tensor values it stored;
load a ``.dcp`` checkpoint only from a directory you trust, as with any DCP checkpoint.
The per-rank files are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import distributed
from .checkpoint_io import (
    describe_os_error,
    load_checkpoint,
    read_manifest,
    replace_directory,
    save_checkpoint,
    temporary_path,
    write_manifest,
)


class ShardedCheckpointError(OSError):
    """A write or read of a sharded checkpoint that failed on at least one rank; the
    message, the same on every rank, names each failing rank and its cause."""


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters or buffers (FSDP2, tensor parallelism):
    state that no one rank holds whole. Its optimizer's state follows its parameters."""
    if not torch.distributed.is_available():  # a build without torch.distributed has no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers()))


def _dcp():  # imported on first use: plain runs never load the DCP machinery
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


def _clone(obj: Any) -> Any:
    """A deep copy with every tensor cloned where it is (a DTensor stays sharded)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _cause(exc: BaseException) -> str:
    """One failure in words. ``torch.save`` writing into a file turns the ``OSError`` of
    a full disk into ``RuntimeError: ... unexpected pos``: said as what it most likely is."""
    text = describe_os_error(exc)
    if not isinstance(exc, OSError) and "unexpected pos" in str(exc):
        text = f"a write was cut short, as on a full disk ({text})"
    return text


def _describe(exc: BaseException) -> str:
    """``rank <r>: <cause>`` for this rank's failure, or for each rank DCP reports."""
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: every rank's cause
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {_cause(failures[r][0])}" for r in sorted(failures))
    return f"rank {distributed.rank()}: {_cause(exc)}"


def _attempt(fn: Callable[[], Any]) -> str | None:
    """Run ``fn``; what went wrong, in words, or ``None``. DCP raises ``CheckpointException``,
    a ``BaseException``: caught here too, and nothing else that is not an ``Exception``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except (Exception, CheckpointException) as exc:
        return _describe(exc)
    return None


def _agree(error: str | None, what: str) -> None:
    """Raise ``ShardedCheckpointError`` on every rank if ``error`` is set on any."""
    errors = distributed.gather_errors(error)
    if errors:
        raise ShardedCheckpointError(f"{what}: {'; '.join(errors)}")


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


def write(path: Path, writer: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
          extras: dict[str, Any], on_commit: Callable[[], None]) -> None:
    """Write the state of ``step`` to checkpoint directory ``path``; every rank calls it.

    ``writer`` is rank 0's ``<host>-<pid>`` (the temporary name), ``on_commit`` runs on
    rank 0 once the checkpoint is in place (pruning), inside the agreed last phase.
    Raises ``ShardedCheckpointError`` on every rank if any rank failed; the temporary
    directory is then removed. A failure before the rename adds no checkpoint; one after
    it (the folder's fsync, pruning) leaves the new checkpoint in place, complete, listed
    like any other. Building the state dicts, before DCP's own agreed phases, is assumed
    to behave alike on every rank (the same model and optimizer, sharded alike).
    """
    dcp, sd = _dcp()
    rank = distributed.rank()
    tmp = temporary_path(path, writer)
    has_state = optimizer is not None and bool(optimizer.state)
    kind = "none" if optimizer is None else "dcp" if has_state else "plain"

    def own_file() -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        side: dict[str, Any] = {"step": step, "extras": {k: o.state_dict() for k, o in extras.items()}}
        if kind == "plain":
            side["optimizer"] = optimizer.state_dict()
        save_checkpoint(_rank_file(tmp, rank), side)

    def shards() -> None:
        state: dict[str, Any] = {"model": sd.get_model_state_dict(model)}
        if kind == "dcp":
            state["optimizer"] = sd.get_optimizer_state_dict(model, optimizer)
        dcp.save(state, checkpoint_id=tmp)

    def commit() -> None:
        write_manifest(tmp, step, distributed.world_size(), kind)
        replace_directory(tmp, path, writer)
        on_commit()

    what = f"writing {path.name}"
    try:
        _agree(_attempt(own_file), what)
        _agree(_attempt(shards), what)
        _agree(_attempt(commit) if rank == 0 else None, what)
    except ShardedCheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def read(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         extras: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Read checkpoint directory ``path`` into copies of this rank's state; every rank
    calls it. Returns the step and the state ``apply`` loads (nothing is loaded yet).
    Raises ``ShardedCheckpointError`` on every rank if any rank could not read its part.

    Each rank reads its own ``rank<r>.pt``; a rank the writing job did not have (a
    restart with more ranks) reads rank 0's, and DCP reshards the model and optimizer
    (a restart with another number of ranks is not tested).
    """
    dcp, sd = _dcp()
    rank = distributed.rank()
    found: dict[str, Any] = {}

    def own_file() -> None:
        manifest = read_manifest(path)
        own = _rank_file(path, rank)
        side = load_checkpoint(own if own.exists() else _rank_file(path, 0))
        if not isinstance(side, dict) or side.get("step") != manifest["step"] \
                or not isinstance(side.get("extras"), dict):
            raise ValueError(f"its rank file does not match its manifest (step {manifest['step']})")
        if manifest.get("optimizer") not in ("dcp", "plain", "none"):
            raise ValueError(f"its manifest's optimizer entry is {manifest.get('optimizer')!r}")
        if manifest["optimizer"] == "plain" and not isinstance(side.get("optimizer"), dict):
            raise ValueError("its rank file holds no optimizer state")
        found.update(manifest=manifest, side=side)

    what = f"reading {path.name}"
    _agree(_attempt(own_file), what)
    manifest, side = found["manifest"], found["side"]
    target: dict[str, Any] = {}

    optimizer_kind = manifest["optimizer"] if optimizer is not None else "none"

    def shards() -> None:
        target["model"] = _clone(sd.get_model_state_dict(model))
        if optimizer_kind == "dcp":
            target["optimizer"] = _clone(sd.get_optimizer_state_dict(model, optimizer))
        dcp.load(target, checkpoint_id=path)

    _agree(_attempt(shards), what)
    # what the checkpoint holds is loaded, as from a file: an object it has no state for
    # (an extra added since, an optimizer it was written without) is left as it is
    state: dict[str, Any] = {"model": target["model"], **{k: v for k, v in side["extras"].items() if k in extras}}
    if optimizer_kind != "none":
        state["optimizer"] = target["optimizer"] if optimizer_kind == "dcp" else side["optimizer"]
    return manifest["step"], state


def apply(model: nn.Module, optimizer: torch.optim.Optimizer | None, extras: dict[str, Any],
          state: dict[str, Any]) -> None:
    """Load what ``read`` returned: the model's and optimizer's name-keyed state through
    ``set_model_state_dict`` / ``set_optimizer_state_dict``, an optimizer without state
    and the extras through their ``load_state_dict``. What a loader may keep rather than
    copy (an optimizer keeps same-device tensors) is copied first, so that later in-place
    updates never write into ``state``."""
    _, sd = _dcp()
    sd.set_model_state_dict(model, state["model"])  # copied into the parameters
    if optimizer is not None and "optimizer" in state:
        if state["optimizer"].get("state"):
            sd.set_optimizer_state_dict(model, optimizer, _clone(state["optimizer"]))
        else:  # the state before the optimizer's first step: nothing to key by name
            optimizer.load_state_dict(_clone(state["optimizer"]))
    for name, obj in extras.items():
        if name in state:
            obj.load_state_dict(_clone(state[name]))
