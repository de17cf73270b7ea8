"""Checkpoint files: atomic writes, complete-archive checks, run ids, stale temporaries.

A checkpoint is written to a temporary file, fsynced, renamed over its name and the
directory fsynced, so a crash mid-write leaves the previous checkpoint intact; it is
loaded with ``weights_only=True``. A file named like a checkpoint that is not a complete
torch archive is told apart cheaply (``looks_complete``), and temporary files of writers
that were killed mid-write are found and removed (``remove_stale_temporaries``). How a
``SnapshotStore`` names, prunes and chooses its files is in ``sdc_guard.respond.snapshot``.

Checkpoints of sharded state are directories (``sdc_guard-<run>-step<N>.dcp``, written by
every rank through ``sdc_guard.respond.sharded_checkpoint``); this module holds what they
share with files: the names, a manifest that tells a complete directory from one cut
short (``MANIFEST``, ``write_manifest``, ``read_manifest``), moving a finished temporary
directory into place and removing a checkpoint so that it disappears at once
(``replace_directory``, ``remove_checkpoint``), and the stale temporaries of either kind.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

#: ``sdc_guard-<run id>-step<N>.pt`` (a file) or ``.dcp`` (a directory of sharded state);
#: files of versions before run ids, without one, too. ``kind`` is ``pt`` or ``dcp``.
CHECKPOINT_PATTERN = re.compile(
    r"^sdc_guard-(?:(?P<run>[A-Za-z0-9_.]+)-)?step(?P<step>-?\d+)\.(?P<kind>pt|dcp)$")
#: A temporary file of ``save_checkpoint`` or directory of a sharded write:
#: ``.<name>.tmp-<host>-<pid>`` (older versions: ``.<name>.tmp-<pid>``); a sharded one
#: carries rank 0's host and process id, the process that moves it into place.
TEMPORARY_PATTERN = re.compile(
    r"^\.sdc_guard-.*\.(?:pt|dcp)\.tmp-(?:(?P<host>[A-Za-z0-9_.]+)-)?(?P<pid>\d+)$")
#: The file a complete checkpoint directory holds last: step, world size, every file and
#: its size (JSON, so that telling complete from cut short unpickles nothing).
MANIFEST = "sdc_guard.json"
MANIFEST_FORMAT = "sdc_guard-dcp-1"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
#: A temporary file whose writer may still be alive is removed only when its last write
#: is older than the run by this much: a writer inside one long ``write()`` call does not
#: touch its file's modification time until the call returns.
STALE_TEMPORARY_SECONDS = 3600.0

_DISK_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
              errno.EFBIG: "the disk is full or a file size limit was reached"}


def host_label() -> str:
    """This host's name as temporary file names carry it (letters, digits, '_', '.')."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def writer_label() -> str:
    """``<host>-<pid>`` of this process: the tail of the temporary names it writes."""
    return f"{host_label()}-{os.getpid()}"


def temporary_path(path: Path, writer: str | None = None) -> Path:
    """The temporary name ``path`` is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp-{writer or writer_label()}")


def new_run_id() -> str:
    """A fresh run id: UTC start time, process id and a random part.

    >>> bool(RUN_ID_PATTERN.match(new_run_id()))
    True
    """
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{os.getpid()}_{secrets.token_hex(3)}"


def describe_os_error(exc: BaseException) -> str:
    """What an error of the disk means, in words (a full disk is named as such).

    >>> describe_os_error(OSError(errno.ENOSPC, "No space left on device"))
    'the disk is full (ENOSPC: No space left on device)'
    """
    number = getattr(exc, "errno", None)
    if not isinstance(exc, OSError) or number is None:
        return f"{type(exc).__name__}: {exc}"
    text = exc.strerror or str(exc)
    what = _DISK_FULL.get(number)
    if not (what and text.startswith(what)):
        text = f"{errno.errorcode.get(number, str(number))}: {text}"
        text = f"{what} ({text})" if what else text
    return f"{text}: {exc.filename}" if exc.filename else text


class _Sink:
    """The file ``torch.save`` writes to: every byte written or an ``OSError`` kept.

    ``torch.save`` turns a failed ``write()`` into ``RuntimeError: unexpected pos ...``;
    keeping the ``OSError`` lets ``save_checkpoint`` say what happened (a full disk).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                written = os.write(self.fd, view[done:])
                if written == 0:  # a short write that makes no progress: nowhere to put it
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += written
        except OSError as exc:
            self.error = self.error or exc
            raise
        return done

    def flush(self) -> None:
        pass


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: readers see the old file or the new one.

    A failed write raises ``OSError`` with the cause's ``errno`` and a message that says
    what it means (``the disk is full``); the temporary file is removed.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> p = save_checkpoint(f"{d}/a.pt", {"w": torch.ones(2)}); load_checkpoint(p)["w"].tolist()
    [1.0, 1.0]
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sink = _Sink(fd)
        try:
            torch.save(state, sink)
            os.fsync(fd)
        except Exception as exc:
            if sink.error is None:
                raise
            cause = OSError(sink.error.errno, sink.error.strerror)
            raise OSError(sink.error.errno, describe_os_error(cause), str(path)) from exc
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    fsync_directory(path.parent)
    return path


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (renames, new files) durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (``weights_only=True``, to CPU)."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def looks_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete torch archive: non-empty, a zip whose central
    directory (written last) is present and names a pickle. Cheap: reads the end of the
    file, never the tensors. A file cut short or not written by torch fails. A directory
    is complete when its manifest is (``read_manifest``).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / "x.pt").write_bytes(b"")
    0
    >>> looks_complete(d / "x.pt"), looks_complete(save_checkpoint(d / "y.pt", {"a": 1}))
    (False, True)
    """
    if os.path.isdir(path):
        try:
            read_manifest(path)
        except (OSError, ValueError):
            return False
        return True
    try:
        if os.path.getsize(path) == 0 or not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def write_manifest(directory: Path, step: int, world_size: int, optimizer: str) -> dict[str, Any]:
    """Write the manifest of a finished checkpoint directory (its last file, fsynced):
    ``step``, ``world_size``, how the optimizer's state was kept (``optimizer``: ``"dcp"``,
    ``"plain"`` or ``"none"``) and the size of every file in it."""
    files = {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file() and e.name != MANIFEST}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size,
                "optimizer": optimizer, "files": files}
    fd = os.open(directory / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = json.dumps(manifest, sort_keys=True).encode()
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"{_DISK_FULL[errno.ENOSPC]} (a short write)", str(directory / MANIFEST))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(directory)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint directory. Raises ``ValueError`` when it is
    missing, not ours, or names a file that is absent or of another size (a copy cut
    short), ``OSError`` when it cannot be read."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"it has no {MANIFEST} (a write that never finished, or not a checkpoint)") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"its {MANIFEST} is not valid JSON") from exc
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or isinstance(step, bool) or not isinstance(step, int)
            or not isinstance(manifest.get("files"), dict)):
        raise ValueError(f"its {MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    for name, size in manifest["files"].items():
        try:
            actual = os.stat(Path(directory) / name).st_size
        except FileNotFoundError:
            raise ValueError(f"{name} is missing") from None
        if actual != size:
            raise ValueError(f"{name} has {actual} bytes, {size} were written")
    return manifest


def replace_directory(tmp: Path, path: Path, writer: str) -> None:
    """Move the finished directory ``tmp`` to ``path``, durably. A directory cannot be
    renamed over a full one: an existing ``path`` (the same step written again after a
    rollback or a restart) is first renamed to a temporary name and removed after."""
    old = None
    if path.exists():
        old = temporary_path(path.with_name(f"{path.stem}-replaced{path.suffix}"), writer)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_directory(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # left behind: a stale temporary, removed later


def remove_checkpoint(path: Path, writer: str | None = None) -> None:
    """Delete checkpoint ``path``, a file or a directory. A directory is renamed to a
    temporary name first, so that it disappears whole even if removing its files fails
    half-way (what is left is a stale temporary, removed later)."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = temporary_path(path.with_name(f"{path.stem}-pruned{path.suffix}"), writer)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def check_checkpoint_dir(checkpoint_dir: Any, name: str = "checkpoint_dir") -> Path:
    """``checkpoint_dir`` as a ``Path``, created if missing, after proving it writable
    (a one-byte file written and removed). Raises ``TypeError`` / ``ValueError`` naming
    ``name``: at construction, not at the first snapshot after an optimizer step.

    >>> import tempfile; check_checkpoint_dir(tempfile.mkdtemp()).is_dir()
    True
    """
    if isinstance(checkpoint_dir, bool) or not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a directory path (str or os.PathLike) or None, "
                        f"got {type(checkpoint_dir).__name__} {checkpoint_dir!r}")
    path = Path(checkpoint_dir)
    if str(checkpoint_dir) == "":
        raise ValueError(f"{name}: expected a directory path, got an empty string")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: expected a directory, got {str(path)!r}, which exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".sdc_guard-write-probe-{host_label()}-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise ValueError(f"{name}: expected a writable directory, got {str(path)!r}: "
                         f"{describe_os_error(exc)}") from exc
    return path


def _writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _last_write(entry: os.DirEntry) -> float:
    """When ``entry`` was last written: for a directory, the newest of it and its files
    (writing into a file does not touch its directory's time)."""
    mtime = entry.stat(follow_symlinks=False).st_mtime
    if entry.is_dir(follow_symlinks=False):
        for inner in os.scandir(entry.path):
            try:
                mtime = max(mtime, inner.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    return mtime


def remove_stale_temporaries(directory: str | os.PathLike, run_started: float) -> list[Path]:
    """Remove temporary files of ``save_checkpoint`` (and temporary directories of sharded
    writes) whose writer is gone; returns them.

    A writer on this host whose process no longer exists is gone; so is a file of this
    process's id from before ``run_started`` (a killed process whose id was reused, as in
    containers where every job is process 1). Any other file (its writer alive, or on
    another host of a shared file system) is removed only when its last write is more
    than ``STALE_TEMPORARY_SECONDS`` older than ``run_started``.
    """
    removed = []
    host, me = host_label(), os.getpid()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = TEMPORARY_PATTERN.match(entry.name)
        if match is None:
            continue
        try:
            mtime = _last_write(entry)
        except OSError:
            continue
        pid = int(match["pid"])
        local = match["host"] in (None, host)
        if local and pid == me:
            stale = mtime < run_started
        elif local and not _writer_alive(pid):
            stale = True
        else:
            stale = mtime < run_started - STALE_TEMPORARY_SECONDS
        if stale:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed
