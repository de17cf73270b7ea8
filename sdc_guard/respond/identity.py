"""Where this process runs: node, ranks and device, as a scheduler names them.

A detection is acted on by people and schedulers that think in nodes and devices, not in
ranks: a rank moves to another node when a job restarts, a device does not. Every event
and exit report therefore carries the ``Identity`` of the process that saw it.

- ``node``: the name the scheduler knows the machine by: ``$SDC_GUARD_NODE`` if set (on
  Kubernetes, set it from the downward API's ``spec.nodeName``: the pod's host name is the
  pod's, not the node's), else Slurm's ``$SLURMD_NODENAME``, else the host name.
- ``rank``, ``local_rank``, ``world_size``: from the default process group if there is
  one, else torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, else 0, 0, 1.
- ``device``: the device the model's parameters live on (``"cuda:3"``, ``"cpu"``);
  ``device_uuid``: its hardware UUID where the runtime tells it (CUDA: ``"GPU-..."``, as
  ``nvidia-smi -L`` prints it), else None; ``device_id``: the UUID where known, else
  ``device``, what identifies the device across restarts on ``node``.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import distributed

log = logging.getLogger("sdc_guard")

ENV_NODE = "SDC_GUARD_NODE"


@dataclass(frozen=True)
class Identity:
    """Where one process runs (see the module docstring)."""

    node: str
    hostname: str
    rank: int
    local_rank: int
    world_size: int
    device: str
    device_uuid: str | None
    pid: int

    @property
    def device_id(self) -> str:
        """The device's UUID where known, else its name on the node (``"cuda:3"``)."""
        return self.device_uuid or self.device

    def as_dict(self) -> dict[str, Any]:
        """The fields and ``device_id``, for JSON."""
        return asdict(self) | {"device_id": self.device_id}


def node_name() -> str:
    """``$SDC_GUARD_NODE``, else ``$SLURMD_NODENAME``, else the host name."""
    return os.environ.get(ENV_NODE) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def default_device() -> torch.device:
    """The device a process without a model to ask uses: the current CUDA device once CUDA
    is initialised (``torch.cuda.set_device`` chose it), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_uuid(device: torch.device) -> str | None:
    """The hardware UUID of a CUDA device (``"GPU-<uuid>"``), else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # an identity is monitoring: it never fails a step
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def local_identity(device: torch.device | str | None = None) -> Identity:
    """This process's ``Identity``; ``device`` defaults to ``default_device()``.

    >>> ident = local_identity("cpu"); ident.device, ident.device_uuid, ident.device_id
    ('cpu', None, 'cpu')
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    if distributed.is_distributed():
        rank, world = distributed.rank(), distributed.world_size()
    else:
        rank, world = max(_env_int("RANK", 0), 0), max(_env_int("WORLD_SIZE", 1), 1)
    return Identity(node=node_name(), hostname=socket.gethostname(), rank=rank,
                    local_rank=max(_env_int("LOCAL_RANK", 0), 0), world_size=world, device=str(dev),
                    device_uuid=device_uuid(dev), pid=os.getpid())


def gather_identities(mine: Identity) -> list[Identity]:
    """Every rank's ``Identity`` in rank order (one ``all_gather_object``; every rank must
    call it). A failing collective is logged and answers with this rank's alone: who to
    drain is worth knowing, but never worth a hang or a changed exit code."""
    if not distributed.is_distributed():
        return [mine]
    try:
        return [Identity(**d) for d in distributed.gather_objects(asdict(mine))]
    except Exception as exc:
        log.error("sdc_guard: could not gather the ranks' nodes and devices (%s: %s); "
                  "the exit report names this rank's only", type(exc).__name__, exc)
        return [mine]
