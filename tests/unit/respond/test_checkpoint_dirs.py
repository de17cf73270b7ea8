"""Checkpoint directories (sharded state's ``.dcp`` checkpoints) on a real disk, in one
process: what tells a complete directory from one cut short, moving one into place and
removing one without leaving half a directory, stale temporary directories, and plain
stores that keep to their files. The writes and reads by every rank of a sharded job
are tested with real process groups in tests/test_fsdp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn


from sdc_guard import SnapshotStore, save_checkpoint  # noqa: E402
from sdc_guard.respond.checkpoint_io import (  # noqa: E402
    CHECKPOINT_PATTERN,
    MANIFEST,
    host_label,
    looks_complete,
    read_manifest,
    remove_checkpoint,
    remove_stale_temporaries,
    replace_directory,
    temporary_path,
    write_manifest,
)


def fake_checkpoint(path: Path, step: int, payload: bytes = b"shard") -> Path:
    """A directory with two data files and its manifest, as a sharded write leaves it."""
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(payload)
    (path / ".metadata").write_bytes(b"meta" * 8)
    write_manifest(path, step, 2, "dcp")
    return path


def test_a_directory_is_complete_only_by_its_manifest(tmp_path: Path) -> None:
    good = fake_checkpoint(tmp_path / "sdc_guard-r-step3.dcp", 3)
    manifest = read_manifest(good)
    assert manifest["step"] == 3 and manifest["files"] == {"__0_0.distcp": 5, ".metadata": 32}
    assert looks_complete(good)

    cut = fake_checkpoint(tmp_path / "sdc_guard-r-step4.dcp", 4, b"a longer shard")
    os.truncate(cut / "__0_0.distcp", 3)  # a copy cut short
    with pytest.raises(ValueError, match="__0_0.distcp has 3 bytes, 14 were written"):
        read_manifest(cut)
    missing = fake_checkpoint(tmp_path / "sdc_guard-r-step5.dcp", 5)
    (missing / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"\.metadata is missing"):
        read_manifest(missing)
    unfinished = tmp_path / "sdc_guard-r-step6.dcp"
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"shard")
    with pytest.raises(ValueError, match="no sdc_guard.json"):
        read_manifest(unfinished)
    foreign = fake_checkpoint(tmp_path / "sdc_guard-r-step7.dcp", 7)
    (foreign / MANIFEST).write_text(json.dumps({"format": "other", "step": 7, "files": {}}))
    garbage = fake_checkpoint(tmp_path / "sdc_guard-r-step8.dcp", 8)
    (garbage / MANIFEST).write_bytes(os.urandom(64))
    assert [looks_complete(p) for p in (cut, missing, unfinished, foreign, garbage)] == [False] * 5


def test_replacing_and_removing_a_directory_leave_no_half_directory(tmp_path: Path) -> None:
    """The same step written again (after a rollback) replaces the old directory whole;
    a pruned directory disappears at once; neither leaves a temporary behind."""
    path = fake_checkpoint(tmp_path / "sdc_guard-r-step2.dcp", 2, b"old")
    tmp = fake_checkpoint(temporary_path(path), 2, b"newer")
    replace_directory(tmp, path, "host-1")
    assert (path / "__0_0.distcp").read_bytes() == b"newer" and read_manifest(path)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    file = save_checkpoint(tmp_path / "sdc_guard-r-step1.pt", {"step": 1})
    remove_checkpoint(path)
    remove_checkpoint(file)
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_directories_go_and_live_writers_keep_theirs(tmp_path: Path) -> None:
    """As for files: a gone writer's directory is removed with everything in it; a live
    writer's stays; another host's goes only once old, judged by the newest file in it
    (writing into a file does not touch its directory's time)."""
    live = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        names = {
            "gone": f".sdc_guard-r-step3.dcp.tmp-{host_label()}-{gone.pid}",
            "live": f".sdc_guard-r-step4.dcp.tmp-{host_label()}-{live.pid}",
            "other_host_old": f".sdc_guard-r-step5.dcp.tmp-elsewhere-{live.pid}",
            "other_host_writing": f".sdc_guard-r-step6.dcp.tmp-elsewhere-{live.pid}",
            "replaced_gone": f".sdc_guard-r-step7-replaced.dcp.tmp-{host_label()}-{gone.pid}",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
        started = time.time() + 1
        two_hours_ago = started - 7200
        for key in ("other_host_old", "other_host_writing"):
            os.utime(tmp_path / names[key], (two_hours_ago, two_hours_ago))
        os.utime(tmp_path / names["other_host_old"] / "__0_0.distcp", (two_hours_ago, two_hours_ago))
        removed = {p.name for p in remove_stale_temporaries(tmp_path, started)}
        assert removed == {names[k] for k in ("gone", "other_host_old", "replaced_gone")}
        assert {p.name for p in tmp_path.iterdir()} == {names[k] for k in ("live", "other_host_writing")}
    finally:
        live.kill()
        live.wait()


def test_a_plain_store_keeps_to_its_files(tmp_path: Path) -> None:
    """A directory checkpoint of a sharded run in the same folder is neither listed,
    restored, pruned nor warned about by a store of plain state."""
    assert CHECKPOINT_PATTERN.match("sdc_guard-run-step-1.dcp")["kind"] == "dcp"
    sharded = fake_checkpoint(tmp_path / "sdc_guard-sharded-step9.dcp", 9)
    (tmp_path / "sdc_guard-sharded-step10.dcp").mkdir()  # incomplete: no warning from a plain store
    model = nn.Linear(4, 4)
    store = SnapshotStore(model, every=1, keep=1, checkpoint_dir=tmp_path, run_id="plain")
    with torch.no_grad():
        model.weight.fill_(1.0)
    store.take(0)
    store.take(1)
    assert [p.name for p in store.checkpoints(all_runs=True)] == ["sdc_guard-plain-step1.pt"]
    assert store.checkpoint_path(2).name == "sdc_guard-plain-step2.pt"
    with torch.no_grad():
        model.weight.fill_(2.0)
    restarted = SnapshotStore(model, checkpoint_dir=tmp_path)  # a new run id: any run's newest
    assert restarted.restore().step == 1 and torch.all(model.weight == 1.0)
    assert looks_complete(sharded) and sorted(p.name for p in tmp_path.iterdir()) == [
        "sdc_guard-plain-step1.pt", "sdc_guard-sharded-step10.dcp", "sdc_guard-sharded-step9.dcp"]
