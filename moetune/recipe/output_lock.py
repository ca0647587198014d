"""One run per output folder: ``training.output_dir`` is checked at the start and held by a lock.

Two runs writing one folder would overwrite each other's checkpoints, export, config.yaml and
metrics, and keep-last would delete the other's checkpoints. The run's process of rank 0 holds
``<output_dir>/.moetune.lock`` from its start to its end (every exit path; the other ranks never
touch it: ``rank0_decides`` gives them rank 0's verdict). The lock is two things at once:

- an advisory ``flock`` on the file, which the kernel releases when the process dies (kill -9
  included) and which NFS clients share through the server's locks;
- a record in the file (pid, host, boot id, process start time, start date, command), refreshed
  by a heartbeat (the file's modification time, every ``HEARTBEAT_S``).

A second run reads the record to name the holder. When the flock is free, the holder is gone on
this host (the kernel dropped it), or it ran on another host: there, filesystems whose locks are
node-local (Lustre's ``localflock``, some FUSE mounts) would show it free while that run lives, so
a record from another host counts as held until its heartbeat is older than ``STALE_AFTER_S``.
Where the filesystem has no locks at all, the record alone decides (a process of this host is
alive if ``os.kill(pid, 0)`` finds it with the same start time; the pid may have been reused).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

LOCK_NAME = ".moetune.lock"
HEARTBEAT_S = 15.0
"""How often the holder touches the lock file."""
STALE_AFTER_S = 120.0
"""A record of another host whose heartbeat is older than this is a dead run's."""
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
"""flock's errors on a filesystem without locks (NFS without lockd, some FUSE mounts)."""


class OutputFolderInUse(ValueError):
    """Another live run holds the output folder."""


def prepare_output_dir(folder: Path, *, field: str) -> bool:
    """Create ``folder`` or refuse, naming ``field``: a path that is a file, a folder that cannot be
    created. Called before any data is read or model built. Returns whether it created the folder."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{field}: {folder} exists and is not a folder (a file?); choose another {field}")
    if folder.is_dir():
        return False
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{field}: {folder} cannot be created ({err.strerror or err}); choose another {field}") from err
    return True


class OutputLock:
    """The lock of one output folder (see the module). ``acquire`` once; ``release`` on every path."""

    def __init__(self, folder: Path, *, field: str = "training.output_dir") -> None:
        self.folder, self.field = folder, field
        self.path = folder / LOCK_NAME
        self._fd: int | None = None
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._created = False
        self.taken_over: dict[str, Any] | None = None
        """The record of a dead holder whose lock this one replaced, if any (for the log)."""

    def acquire(self) -> None:
        """Create and check the folder, then take the lock or raise ``OutputFolderInUse`` naming the
        holder (pid, host, since when, its command)."""
        self._created = prepare_output_dir(self.folder, field=self.field)
        for _ in range(10):  # a release between our open and our flock unlinks the file: open again
            fd = self._open()
            try:
                locked = self._flock(fd)
                if locked is False:  # held by a live process
                    raise OutputFolderInUse(self._in_use(_holder_record(fd), "it holds the file's lock"))
                if not self._same_file(fd):
                    continue
                holder = _parse(_read(fd))
                if holder is not None:
                    reason = _alive(holder, lock_free=locked is True, age_s=time.time() - os.fstat(fd).st_mtime)
                    if reason:
                        raise OutputFolderInUse(self._in_use(holder, reason))
                    self.taken_over = holder
                self._write_record(fd)
                if locked is None and not self._still_ours(fd):  # no flock here: a racing run wrote after us
                    raise OutputFolderInUse(self._in_use(_parse(_read(fd)) or {}, "it started at the same moment"))
                self._fd, fd = fd, None
                self._start_heartbeat()
                return
            finally:
                if fd is not None:
                    os.close(fd)
        raise OutputFolderInUse(f"{self.field}: {self.path} keeps changing under this run; another run is starting "
                                "or stopping in the same folder")

    def release(self) -> None:
        """Give the folder back: remove the lock file (if it is still this run's) and drop the flock;
        a folder this run created and left empty (it failed before writing anything) goes too."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._same_file(fd) and (_parse(_read(fd)) or {}).get("token") == self._token:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # under the flock: a run waiting on this file opens the path anew
        finally:
            os.close(fd)
        if self._created:
            with contextlib.suppress(OSError):  # not empty: the run's files stay
                self.folder.rmdir()

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"{self.field}: cannot write into {self.folder} ({err.strerror or err}: {self.path}); "
                             f"make it writable or choose another {self.field}") from err

    @staticmethod
    def _flock(fd: int) -> bool | None:
        """True: flocked now; None: the filesystem has no locks. Held elsewhere: False."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno in _NO_LOCKS:
                return None
            raise

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _write_record(self, fd: int) -> None:
        record = {"token": self._token, "pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                  "process_start": _process_start(os.getpid()),
                  "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)[:300]}
        data = json.dumps(record).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def _still_ours(self, fd: int, settle_s: float = 0.2) -> bool:
        time.sleep(settle_s)
        return (_parse(_read(fd)) or {}).get("token") == self._token

    def _start_heartbeat(self) -> None:
        fd = self._fd

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):  # a missed beat only makes the record look older
                    os.utime(fd)

        self._stop.clear()
        self._heartbeat = threading.Thread(target=beat, name="moetune-output-lock", daemon=True)
        self._heartbeat.start()

    def _in_use(self, holder: dict[str, Any], reason: str) -> str:
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {holder.get('since', '?')}"
               + (f": {holder['command']}" if holder.get("command") else ""))
        return (f"{self.field}: {self.folder} is in use by another moetune run ({who}; {reason}). Two runs in one "
                f"folder would overwrite each other's checkpoints, export and metrics: wait for it to end, or choose "
                f"another {self.field}. If that run is gone, delete {self.path}.")


def _alive(holder: dict[str, Any], *, lock_free: bool, age_s: float) -> str | None:
    """Why the run of ``holder`` still holds the folder, or None when it is gone. ``lock_free``: the
    flock was free (False: the filesystem has no locks)."""
    same_host = holder.get("host") == socket.gethostname() and holder.get("boot_id") in (None, _boot_id())
    if same_host:
        if lock_free:  # the kernel released its lock: that process ended
            return None
        pid = holder.get("pid")
        if isinstance(pid, int) and _pid_alive(pid, holder.get("process_start")):
            return "its process is running"
        return None
    if age_s < STALE_AFTER_S:
        return f"another host; its last sign of life was {age_s:.0f} s ago, and it counts as gone after {STALE_AFTER_S:.0f} s"
    return None


def _pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start  # another start time: the pid was reused


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _holder_record(fd: int, *, wait_s: float = 0.5) -> dict[str, Any]:
    """The record of a live holder; one that has just taken the lock may not have written it yet."""
    record = _parse(_read(fd))
    if record is None:
        time.sleep(wait_s)
        record = _parse(_read(fd))
    return record or {}


def _read(fd: int) -> bytes:
    return os.pread(fd, 65536, 0)


def _parse(data: bytes) -> dict[str, Any] | None:
    """The record, or None for an empty file (a lock being created or released) or a damaged one."""
    try:
        record = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None
