"""The calling process's temporary directories, removed even when that process is killed.

A job's working directory (tasks, heartbeats, results) and the stage files its workers read live in
one directory per calling process, ``pipetrain-<pid>-*`` under the temporary directory. A process that
exits removes it. One killed with SIGKILL cannot, and at that moment no worker may be running to do it
for it (the caller may be between two jobs: profiling done, training not yet started). So the first
job also starts a cleaner: a process of a few standard-library lines, no torch, that waits for the
caller to end and then removes that directory and multiprocessing's (where the fork server's socket
lives). It is started detached from the terminal's process group, so a Ctrl-C there does not stop it before the caller.
"""
from __future__ import annotations

import multiprocessing.util
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

CLEANER = """\
import os, select, shutil, sys, time  # pipetrain's cleaner: removes its caller's temporary directories
caller = int(sys.argv[1])
try:
    select.select([os.pidfd_open(caller)], [], [])
except (OSError, AttributeError):  # no pidfd here, or the caller is gone already: wait to be orphaned
    while os.getppid() == caller:
        time.sleep(1)
for d in sys.argv[2:]:
    shutil.rmtree(d, ignore_errors=True)
"""
"""The cleaner's program, run as ``python -I -S -c CLEANER caller_pid dir ...``."""

_mine: dict[int, tuple[Path, int]] = {}  # pid -> (its directory, its cleaner's pid)


def caller_dir() -> Path:
    """This process's directory for pipetrain's temporary files, made (with its cleaner) on first use."""
    pid = os.getpid()
    if pid not in _mine:  # keyed by pid: a forked child makes its own
        theirs = multiprocessing.util.get_temp_dir()
        # the cleaner starts before the directory exists, so no moment leaves it without one
        d = Path(tempfile.gettempdir()) / f"pipetrain-{pid}-{secrets.token_hex(4)}"
        # spawned without a Popen object, which would warn at exit that its still waiting child is running
        quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
        cleaner = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", CLEANER, str(pid), str(d), theirs],
                                 os.environ, file_actions=quiet, setsid=True)
        d.mkdir(mode=0o700)
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(d),), kwargs={"ignore_errors": True},
                                      exitpriority=-100)
        _mine[pid] = (d, cleaner)
    return _mine[pid][0]


def scratch_dir(prefix: str) -> str:
    """A new directory inside :func:`caller_dir`; the caller removes it when done with it."""
    return tempfile.mkdtemp(prefix=prefix, dir=caller_dir())
