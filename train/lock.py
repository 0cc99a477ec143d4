"""One run at a time in an output folder.

A second run started on a folder that a live run writes (the command rerun while the first
still runs, or the workers a killed `accelerate launch` left behind) would interleave their
checkpoints, answer shards and metrics. The main process of a run holds an OS file lock
(`flock`) on `FOLDER/.headstart.lock` while it works; the OS releases it however the process
ends, so a kill leaves no stale lock behind. Where the platform or the filesystem has no
`flock`, nothing is checked.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from heads.export import remove_made
from train.typed_config import RecipeError

LOCK_NAME = ".headstart.lock"
_held: dict[str, int] = {}  # resolved folder -> the descriptor holding its lock


def lock_output(key: str, folder: str | Path) -> None:
    """Take `folder`'s lock for this process, or a RecipeError naming the run that holds it.
    A folder not made yet is no live run's (nothing is made for it: bad input found later
    leaves nothing behind); a run takes the lock again once it has made the folder. Taking a
    lock this process holds already does nothing."""
    try:
        import fcntl
    except ImportError:  # Windows
        return
    path = Path(folder)
    real = str(path.resolve())
    if real in _held or not path.is_dir():
        return
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # removed meanwhile by a refused run that had made it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path / LOCK_NAME).st_ino:
            # a refused run removed the file after this one opened it: lock the one there now
            os.close(fd)
            return lock_output(key, folder)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RecipeError(
            f"'{key}' is {folder}, which another run is writing now ({holder}): wait for it "
            "to end or stop it, or give another folder"
        ) from None
    except FileNotFoundError:  # the file (or its folder) removed since: made again, if needed
        os.close(fd)
        return lock_output(key, folder)
    except OSError:  # a filesystem without flock (some network ones): not checked
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    _held[real] = fd


def release_output_locks() -> None:
    """Release every lock this process holds (a run's end; tests run several in one process)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the descriptor releases its flock


def remove_unused(made: list[Path]) -> None:
    """After a run refused for bad input: remove the folders it made (`made`, deepest first),
    with the lock file it left in the deepest, while nothing else is in them (another run may
    have begun there since: a lock held by a live run is left as it is; one that opened the
    file just before it went locks the new one, `lock_output`'s inode check)."""
    lock = made[0] / LOCK_NAME if made else None  # refused before it was made: none
    if lock is not None and lock.is_file() and [p.name for p in made[0].iterdir()] == [LOCK_NAME]:
        # Windows (no lock was taken), the file gone meanwhile, or a live run's: left
        with contextlib.suppress(ImportError, OSError):
            import fcntl

            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no live run holds it
                lock.unlink()
            finally:
                os.close(fd)
    remove_made(made)
