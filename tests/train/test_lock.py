"""One run at a time in an output folder (train/lock.py): a second run on a folder that a live
run holds is refused before any work, and a killed run leaves no lock behind."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import train.medusa
from tests.train.conftest import TINY_MEDUSA, run
from train.lock import LOCK_NAME, lock_output, release_output_locks
from train.typed_config import RecipeError

ROOT = Path(__file__).parents[2]

HOLD = """
import sys, time
from train.lock import lock_output
lock_output("output.dir", sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s lock, as a run in progress does."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_folder_another_run_writes_is_refused_and_freed_when_it_dies(tiny_task, tmp_path, capsys):
    out = tmp_path / "out"
    lock_output("output.dir", out)  # not made yet: no live run's, and not made for it
    assert not out.exists()
    out.mkdir()
    holder = hold_lock(out)
    try:
        with pytest.raises(RecipeError, match=rf"'output.dir' is {out}, which another run is wr"):
            lock_output("output.dir", out)
        assert f"pid {holder.pid} on " in (out / LOCK_NAME).read_text()
        with pytest.raises(SystemExit) as exit_:  # the training script, before the base loads
            run(train.medusa, TINY_MEDUSA, tiny_task, out)
        assert exit_.value.code == 2
        assert f"(pid {holder.pid} on " in capsys.readouterr().err
        sys.path.insert(0, str(ROOT / "scripts"))
        import distill

        assert distill.main([str(TINY_MEDUSA), f"data.output_dir={out}"]) == 2
        assert "which another run is writing now" in capsys.readouterr().err
    finally:
        holder.kill()  # as a kill ends a run: the OS drops its lock
        holder.wait()
    lock_output("output.dir", out)  # free now; taking it again in this process is a no-op
    lock_output("output.dir", out)
    release_output_locks()
    holder = hold_lock(out)  # released: another process takes it
    holder.kill()
    holder.wait()


def test_the_lock_file_names_only_the_run_that_holds_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text("pid 123456789 on a-machine-with-a-long-name-from-an-old-run")
    try:
        lock_output("output.dir", out)
        assert (out / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    finally:
        release_output_locks()


def test_a_folder_this_run_holds_is_its_own_under_another_path(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "link").symlink_to(out)
    monkeypatch.chdir(tmp_path)
    try:
        lock_output("output.dir", out)
        lock_output("data.output_dir", "out")  # relative: the same folder, no second lock
        lock_output("output.dir", tmp_path / "link")
        assert (out / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    finally:
        release_output_locks()


def test_a_refused_run_removes_only_the_empty_folders_it_made_and_no_live_lock(tmp_path):
    """`remove_unused` after a refusal: the folders made go with their lock file, but not while
    another run holds that lock or has written beside it."""
    from train.lock import remove_unused

    made = [tmp_path / "a" / "b", tmp_path / "a"]
    made[0].mkdir(parents=True)
    lock_output("output.dir", made[0])
    release_output_locks()  # the refused run's own, released first
    holder = hold_lock(made[0])  # another run began there meanwhile
    try:
        remove_unused(made)
        assert (made[0] / LOCK_NAME).is_file()
    finally:
        holder.kill()
        holder.wait()
    (made[0] / "metrics.jsonl").touch()  # another run's file
    remove_unused(made)
    assert sorted(p.name for p in made[0].iterdir()) == [LOCK_NAME, "metrics.jsonl"]
    (made[0] / "metrics.jsonl").unlink()
    remove_unused(made)
    assert not (tmp_path / "a").exists()
    remove_unused(made)  # refused before the folder was made: nothing to do


def test_a_lock_file_removed_while_it_is_taken_is_taken_anew(tmp_path, monkeypatch):
    """A refused run may remove the lock file just after another opened it: that one then
    locks the file there now, not the removed one (which a third run could not see)."""
    out = tmp_path / "out"
    out.mkdir()
    real_open, opened = os.open, []

    def open_then_removed(path, *args):
        fd = real_open(path, *args)
        if not opened:
            Path(path).unlink()  # the refused run's removal, between open and flock
        opened.append(path)
        return fd

    monkeypatch.setattr(os, "open", open_then_removed)
    lock_output("output.dir", out)
    monkeypatch.setattr(os, "open", real_open)
    try:
        assert len(opened) == 2  # opened again after the removal
        other = subprocess.run(
            [sys.executable, "-c", HOLD, str(out)], cwd=ROOT, capture_output=True, text=True
        )
        assert other.returncode == 1 and "which another run is writing now" in other.stderr
    finally:
        release_output_locks()
