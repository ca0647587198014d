"""One run per output folder: a second run is refused naming the holder; a dead holder's lock (kill -9)
is taken over; the lock goes on every exit path; a killed checkpoint write is cleaned up and resumed."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetune.recipe import checkpointing, output_lock, train
from moetune.recipe.config_loading import save_config
from moetune.recipe.output_lock import LOCK_NAME, OutputFolderInUse, OutputLock
from moetune.recipe.train import finetune

from recipe_helpers import REPO, losses, read_metrics, subprocess_env

# Holds the lock in a process of its own until its stdin closes; loads output_lock.py alone (the
# standard library only), so it starts at once.
HOLDER = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("output_lock", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
lock = module.OutputLock(Path(sys.argv[2]))
lock.acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _hold(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, output_lock.__file__, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _no_data_work(monkeypatch):
    monkeypatch.setattr(train, "prepare_data", lambda *a, **k: pytest.fail("the data was prepared"))


def test_a_second_run_is_refused_naming_the_holder_and_runs_once_it_ended(tiny_job, tmp_path, monkeypatch):
    out = tmp_path / "out"
    holder = _hold(out)
    try:
        with monkeypatch.context() as patch:
            _no_data_work(patch)
            with pytest.raises(OutputFolderInUse, match=rf"training.output_dir: {out} is in use by another moetune run "
                                                        rf"\(pid {holder.pid} on host {socket.gethostname()}, since 20"):
                finetune(tiny_job(out))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not (out / LOCK_NAME).exists()
    assert finetune(tiny_job(out, training__steps=2)).step == 2


def test_the_lock_of_a_killed_run_is_taken_over(tiny_job, tmp_path, capsys):
    out = tmp_path / "out"
    holder = _hold(out)
    holder.kill()  # kill -9: no clean-up of its own
    holder.wait(timeout=30)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid
    assert finetune(tiny_job(out, training__steps=2)).step == 2
    assert f"(pid {holder.pid} on host {socket.gethostname()}" in capsys.readouterr().out
    assert not (out / LOCK_NAME).exists()


def test_without_file_locks_the_record_decides(tmp_path, monkeypatch):
    """On a filesystem without locks (NFS without lockd, some FUSE mounts) flock fails with ENOLCK:
    a holder of this host is alive while its process (pid and start time) runs."""
    out = tmp_path / "out"
    holder = _hold(out)

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    try:
        with pytest.raises(OutputFolderInUse, match=rf"pid {holder.pid} .*its process is running"):
            OutputLock(out).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with OutputLock(out) as lock:
        assert lock.taken_over["pid"] == holder.pid
    assert not (out / LOCK_NAME).exists()


def test_who_holds_a_lock_whose_flock_is_free():
    """A record whose flock is free (or unsupported: ``lock_free`` False) is decided by its host: on this
    host (its name and boot id) by its process (pid and start time); on another host (or one of the
    same name that booted otherwise) by its heartbeat's age, as node-local flocks (Lustre's
    localflock, some FUSE mounts) would not show it."""
    here = {"host": socket.gethostname(), "boot_id": output_lock._boot_id(), "pid": os.getpid(),
            "process_start": output_lock._process_start(os.getpid())}
    assert output_lock._alive(here, lock_free=False, age_s=0) == "its process is running"
    assert output_lock._alive(here, lock_free=True, age_s=0) is None  # the kernel dropped its flock: it ended
    assert output_lock._alive({**here, "process_start": here["process_start"] + 1}, lock_free=False, age_s=0) is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert output_lock._alive({**here, "pid": int(dead.stdout), "process_start": None}, lock_free=False, age_s=0) is None
    for elsewhere in ({**here, "host": "another-node"}, {**here, "boot_id": "another boot"}):
        assert "another host" in output_lock._alive(elsewhere, lock_free=True, age_s=5)
        assert output_lock._alive(elsewhere, lock_free=False, age_s=output_lock.STALE_AFTER_S + 1) is None


def test_the_lock_is_released_on_every_exit_path(tiny_job, tmp_path, monkeypatch):
    out = tmp_path / "out"
    lock_file = out / LOCK_NAME
    with pytest.raises(ValueError, match="data.train_path"):  # a user's mistake after the lock was taken
        finetune(tiny_job(out, data__train_path=tmp_path / "missing.jsonl"))
    assert not lock_file.exists() and not out.exists()  # it created the folder and wrote nothing: removed
    real_step, calls = train.train_step, {"n": 0}

    def interrupted_then_poisoned(model, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        if calls["n"] == 3:
            next(model.parameters()).data.fill_(math.nan)
        return real_step(model, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", interrupted_then_poisoned)
    assert finetune(tiny_job(out, training__steps=4)).interrupted
    assert not lock_file.exists()
    with pytest.raises(train.NonFiniteLossError):
        finetune(tiny_job(out, training__steps=4, checkpoint__resume="auto"))
    assert not lock_file.exists()


def _cli(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moetune.cli", "finetune", "-c", str(config), *extra]


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"{path} did not appear"


def test_two_cli_runs_into_one_folder(tiny_job, tmp_path):
    """The second `moetune finetune` into a running one's folder exits 2 naming it, touching nothing;
    the first, stopped by Ctrl-C, resumes in its own folder."""
    out = tmp_path / "out"
    config = tmp_path / "job.yaml"
    save_config(tiny_job(out, training__steps=100_000), config)
    env = subprocess_env()
    first = subprocess.Popen(_cli(config), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(out / LOCK_NAME, first)  # held from the start of the run
        second = subprocess.run(_cli(config), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"is in use by another moetune run (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        _wait_for(out / "metrics.jsonl", first)  # training: Ctrl-C now saves a checkpoint
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130, first.stdout.read()
    finally:
        if first.poll() is None:
            first.kill()
    assert not (out / LOCK_NAME).exists()
    step = checkpointing.read_train_state(checkpointing.list_checkpoints(str(out))[-1]).step
    assert sorted(losses(read_metrics(out))) == list(range(1, step + 1))  # the first run's records only
    resumed = finetune(tiny_job(out, training__steps=step + 1, checkpoint__resume="auto"))
    assert resumed.step == step + 1 and len(resumed.losses) == 1


# Runs the job, killing itself (SIGKILL) at its second checkpoint, after the model and optimizer
# shards are written and before the checkpoint is complete.
KILLED_MID_CHECKPOINT = """
import os, signal, sys
from moetune.recipe import checkpointing
real_save, saves = checkpointing.save_dcp, []
def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)
    saves.append(1)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
checkpointing.save_dcp = save_then_die
from moetune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_during_a_checkpoint_write_loses_nothing(tiny_job, tmp_path, capsys):
    """The killed run leaves its last complete checkpoint, a half-written temporary folder and its lock;
    the next run takes the lock, removes the half checkpoint, and resumes to the same losses as an
    uninterrupted run."""
    out = tmp_path / "out"
    config = tmp_path / "job.yaml"
    save_config(tiny_job(out, training__steps=6, checkpoint__every=2), config)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_CHECKPOINT, "finetune", "-c", str(config)], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    killed_pid = json.loads((out / LOCK_NAME).read_text())["pid"]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp_step_00000004", "step_00000002"]
    assert (out / LOCK_NAME).exists()
    finetune(tiny_job(out, training__steps=6, checkpoint__every=2, checkpoint__resume="auto"))
    printed = capsys.readouterr().out
    assert f"(pid {killed_pid} on host {socket.gethostname()}" in printed and "is gone; this run holds it now" in printed
    assert f"removed {root / '.tmp_step_00000004'}" in printed
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
    uninterrupted = finetune(tiny_job(tmp_path / "full", training__steps=6))
    assert losses(read_metrics(out)) == dict(enumerate(uninterrupted.losses, start=1))
