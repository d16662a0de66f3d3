"""Start local worker processes, or run as one rank under torchrun.

Locally, workers are forked from a fork server: a clean process that has imported torch,
``torch._dynamo`` (which building the first optimizer imports, seconds on a CPU) and pipetrain, and has
run nothing, so no thread pool or CUDA context is forked. A worker then starts in a fraction of a
second instead of paying those imports again; only a process's first job pays for starting the server.
The caller itself is never forked (its thread pools would not survive it), so, as with spawn,
arguments must pickle; objects defined at module level of the caller's script do. When one worker
fails, the others are stopped at once and the first failure's one-line message is raised in the caller.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import PipetrainError, first_line, one_line
from pipetrain.runtime.scratch import caller_dir


def under_torchrun() -> bool:
    """True when launched by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_caller(caller: int) -> None:
    """End this worker when the process that called ``spawn`` dies (even by SIGKILL), so a killed job
    leaves no workers behind; elsewhere than Linux the workers' own timeouts end them.

    [Note: orphans] A worker's parent is the fork server, not the caller, and every worker holds the
    fork server's "caller alive" pipe open (multiprocessing passes it on so workers could start
    processes of their own), so the fork server outlives a killed caller while workers run. So a
    thread waits on a pidfd of the caller and ends the worker when it exits; then the fork server sees
    the pipe close and exits too. The parent-death signal covers the fork server itself dying. The
    caller's temporary directories are its cleaner's to remove (:mod:`pipetrain.runtime.scratch`).
    """
    if not die_with_parent():
        return
    try:
        fd = os.pidfd_open(caller)
    except ProcessLookupError:  # the caller died while this worker started
        os._exit(1)
    except (OSError, AttributeError):
        return
    import select

    def watch() -> None:
        select.select([fd], [], [])  # readable once the caller has exited
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="pipetrain-caller-watch").start()


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux); False elsewhere."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    return True


def keep_freed_memory() -> None:
    """Tell glibc's malloc to serve large blocks from its heap and keep what is freed, so the next
    step reuses it.

    [Note: page faults] By default glibc maps every block over 32 MiB fresh and unmaps it when freed,
    so a training step page-faults through each large gradient, activation and optimizer temporary
    again (the kernel also zeroes every page). For a model with large layers (vgg-like's 107 MB
    gradient) those faults are a large share of a CPU worker's forward, backward, gradient copy and
    optimizer step. The cost: a worker holds on to its peak memory, as a caching allocator does.
    Elsewhere than glibc this does nothing.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: blocks up to 1 GiB come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed memory
    except (OSError, AttributeError):
        pass


HEARTBEAT_S = 0.5
"""How often a locally launched worker shows it is alive (a thread touching a file)."""


def _heartbeat(beat: Path) -> None:
    """Touch ``beat`` every HEARTBEAT_S from a thread: a stopped process stops touching it, a slow one
    does not (torch releases the GIL while it computes)."""
    def loop() -> None:
        while True:
            try:
                beat.touch()
            except OSError:  # the caller is gone and took the directory: this process is ending
                return
            time.sleep(HEARTBEAT_S)
    beat.touch()
    threading.Thread(target=loop, daemon=True, name="pipetrain-heartbeat").start()


def _child(rank: int, world: int, port: int, workdir: str, caller: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it stops the workers
    _die_with_caller(caller)
    _heartbeat(_beat(workdir, rank))
    _stacks_on_request(Path(workdir) / f"stacks{rank}.txt")
    keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), PIPETRAIN_SPAWNED="1", PIPETRAIN_WORKDIR=workdir)
    code = 0
    try:
        task = _task(workdir, rank)
        with open(task, "rb") as f:
            fn, args = pickle.load(f)
        task.unlink()
        torch.save(fn(*args), Path(workdir) / f"result{rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then the process ends
        msg = first_line(e, None) if isinstance(e, PipetrainError) else one_line(e, None)
        with contextlib.suppress(OSError):  # the caller may be gone already, with the directory
            (Path(workdir) / f"error{rank}.txt").write_text(msg + "\n" +
                                                            traceback.format_exc())
        code = 1
    # [Note: hard exit] communication threads may sit in a blocking recv on a dead peer; a normal
    # interpreter exit would wait on process-group teardown, so leave without it.
    os._exit(code)


def spawn(fn: Callable[..., Any], world: int, args: tuple | Callable[[int], tuple],
          describe: Callable[[int], str] = "rank {}".format, poll_s: float = 0.05, silent_after: float | None = None,
          log_dir: str | os.PathLike | None = None, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` processes with RANK/WORLD_SIZE set; return each rank's result.

    ``args`` may be a function of the rank giving that rank's arguments: each rank is then sent only
    its own (a pipeline worker its stage), made just before its process starts, so the caller never
    holds every rank's at once.

    Results travel through ``torch.save``/``torch.load(weights_only=True)``: plain data and tensors.
    Each worker shows a sign of life every HEARTBEAT_S; one that shows none for ``silent_after``
    seconds (stopped, hung) is named and the job stopped. A job still running ``timeout`` seconds
    after it started is stopped too (a worker waiting forever in code that lets the heartbeat go on).
    Before a silent or timed-out job is stopped, each running worker writes every thread's Python
    stack (``faulthandler``) to a file the message names: where it was stuck. The rendezvous listens
    on 127.0.0.1 only, on a free port.

    Raises:
        PipetrainError: a worker raised (its first line is the message), died or went silent, or the
            job ran past ``timeout``; every failed worker's traceback is kept in a file under
            ``log_dir`` (default: the temporary directory) that the message names, and the history the
            workers streamed rides along.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "pipetrain"])  # once per caller process
    args_of = args if callable(args) else lambda rank: args
    for attempt in range(PORT_TRIES):
        try:
            return _spawn_once(ctx, fn, args_of, world, _free_port(), describe, poll_s, silent_after, log_dir,
                               timeout)
        except PipetrainError as e:
            if (_PORT_TAKEN not in str(e) and e.kind != "unstarted") or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


PORT_TRIES = 3
"""Launches tried when another program takes the free port before rank 0 binds it, or a worker
process never starts (it ran none of the job, so starting again loses nothing)."""

START_S = 120.0
"""A worker process that has not begun its task this long after it was started is declared unstarted."""
_PORT_TAKEN = "on 127.0.0.1 is in use"


def _spawn_once(ctx: Any, fn: Callable[..., Any], args_of: Callable[[int], tuple], world: int, port: int,
                describe: Callable[[int], str], poll_s: float, silent_after: float | None,
                log_dir: str | os.PathLike | None, timeout: float | None) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="job-", dir=caller_dir()) as workdir:
        procs = [ctx.Process(target=_child, args=(r, world, port, workdir, os.getpid()),
                             daemon=False) for r in range(world)]
        started = []
        since = time.monotonic()
        try:
            for r, p in enumerate(procs):
                # [Note: pickle by value] multiprocessing pickles Process arguments with torch's reducers,
                # which move tensors to shared memory: every worker, and the caller's model, would then
                # update one copy of the weights. Plain pickle, to a file the worker reads, gives each
                # worker its own copy, and leaves nothing of it in the caller.
                with open(_task(workdir, r), "wb") as f:
                    pickle.dump((fn, args_of(r)), f, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    p.start()
                except OSError as e:  # the new process was killed before it read its task
                    raise PipetrainError(f"{describe(r)} died while starting ({e.strerror or e}){_unguarded_script_hint()}",
                                         "died", r) from None
                started.append(p)
            while any(p.exitcode is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise _failure(workdir, failed, procs, describe, log_dir)
                waiting = [r for r, p in enumerate(procs) if p.exitcode is None and not _beat(workdir, r).exists()] \
                    if time.monotonic() - since > START_S else []
                if waiting:
                    raise PipetrainError(f"{describe(waiting[0])} did not start within {START_S:.0f}s (its process "
                                         "never began the task)", "unstarted", waiting[0])
                silent = _silent(workdir, procs, silent_after)
                if silent is not None:
                    rank, age = silent
                    raise _stuck(f"{describe(rank)} went silent: no sign of life for {age:.0f}s (stopped, or stuck in "
                                 "code that holds the GIL); the other workers were stopped", "silent", rank, workdir,
                                 procs, log_dir)
                if timeout is not None and time.monotonic() - since > timeout:
                    running = [r for r, p in enumerate(procs) if p.exitcode is None]
                    if not running:  # the last worker finished since the loop's check: take its results
                        continue
                    raise _stuck(f"{', '.join(map(describe, running))} still running after {timeout:g}s, the job's "
                                 "time limit; the workers were stopped", "timeout", running[0], workdir, procs,
                                 log_dir)
                time.sleep(poll_s)
            failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
            if failed:
                raise _failure(workdir, failed, procs, describe, log_dir)
            return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=True) for r in range(world)]
        finally:
            for p in started:
                if p.exitcode is None:
                    p.kill()
            for p in started:
                p.join(10)


# What a worker says when a peer is gone: ours, and gloo's for a closed connection.
_COMPLAINTS = ("went silent", "Connection reset by peer", "Connection closed by peer", "Broken pipe")

LOADER_DIED = "its loader process died"
"""What a worker's error says when one of its data loaders died: the job counts it as the worker's death."""


def _failure(workdir: str, failed: list[int], procs: list, describe: Callable[[int], str],
             log_dir: str | os.PathLike | None) -> PipetrainError:
    """The most telling failure: a worker that died without an error (killed, crashed: the others'
    errors follow from it) or lost a loader process, then a worker's own error, then a neighbour's complaint about a lost peer;
    the tracebacks kept in a file."""
    messages, order, texts = {}, {}, []
    for r in failed:
        f = Path(workdir) / f"error{r}.txt"
        if f.exists():
            text = f.read_text()
            messages[r] = text.splitlines()[0]
            order[r] = 0 if LOADER_DIED in messages[r] else 2 if any(c in messages[r] for c in _COMPLAINTS) else 1
            texts.append(f"== {describe(r)}\n{text}")
        else:
            code = procs[r].exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"died with exit code {code}"
            if code > 0 and not _beat(workdir, r).exists():
                how += " before it began its task" + _unguarded_script_hint()
            messages[r], order[r] = f"{describe(r)} {how}", 0
    rank = min(failed, key=lambda r: (order[r], r))
    log = _keep("failure", texts, log_dir)
    message = messages[rank] + (f" (tracebacks: {log})" if log else "")
    return _with_history(PipetrainError(message, ("died", "error", "died")[order[rank]], rank, log), workdir)


def _stacks_on_request(path: Path) -> None:
    """Write every thread's Python stack to ``path`` when this process gets SIGUSR1 (``faulthandler``
    writes from the signal handler, so it works even while a thread holds the GIL)."""
    try:
        faulthandler.register(signal.SIGUSR1, file=open(path, "w"), all_threads=True)  # noqa: SIM115 - kept open
    except (OSError, AttributeError, ValueError):  # no SIGUSR1 (Windows) or the directory is gone
        pass


STACKS_WAIT_S = 2.0
"""How long a stopping job waits for its running workers to write their stacks."""


def _stuck(message: str, kind: str, rank: int, workdir: str, procs: list,
           log_dir: str | os.PathLike | None) -> PipetrainError:
    """The error for a job that is stopped while its workers run: each running worker is asked for its
    Python stacks first, kept in a file that the message names."""
    running = [(r, p) for r, p in enumerate(procs) if p.exitcode is None]
    for _, p in running:
        with contextlib.suppress(OSError, ValueError):
            os.kill(p.pid, signal.SIGUSR1)
    files = [Path(workdir) / f"stacks{r}.txt" for r, _ in running]
    deadline = time.monotonic() + STACKS_WAIT_S
    # faulthandler writes a stack a line at a time: read once every file is non-empty and has stopped
    # growing (on a loaded machine, a file read as soon as it is non-empty may hold a stack cut short)
    sizes: list[int] = []
    while time.monotonic() < deadline:
        now = [f.stat().st_size if f.exists() else 0 for f in files]
        if all(now) and now == sizes:
            break
        sizes = now
        time.sleep(0.05)
    texts = [f"== rank {r}\n{f.read_text()}" for (r, _), f in zip(running, files) if f.exists() and f.stat().st_size]
    log = _keep("stacks", texts, log_dir)
    error = PipetrainError(message + (f" (Python stacks: {log})" if log else ""), kind, rank, log)
    return _with_history(error, workdir)


def _keep(what: str, texts: list[str], log_dir: str | os.PathLike | None) -> Path | None:
    """``texts`` in a new file ``pipetrain-{what}-*.log`` under ``log_dir`` (default: the temporary
    directory); None when there is nothing to keep or it cannot be written."""
    if not texts:
        return None
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log = Path(log_dir or tempfile.gettempdir()) / f"pipetrain-{what}-{stamp}.log"
    try:
        log.write_text("\n".join(texts))
    except OSError:
        return None
    return log


def _task(workdir: str, rank: int) -> Path:
    """The file holding worker ``rank``'s function and arguments, pickled; the worker deletes it once read."""
    return Path(workdir) / f"task{rank}.pkl"


def _beat(workdir: str, rank: int) -> Path:
    """The file worker ``rank`` touches to show it is alive (:func:`_heartbeat`); none until it begins its task."""
    return Path(workdir) / f"alive{rank}"


def _unguarded_script_hint() -> str:
    """The likely cause when a worker dies before it begins its task (or while it is being started), as
    words to append: a new process first imports the caller's script, so a script that calls ``train``
    unguarded starts workers from a worker, which multiprocessing refuses. Empty without a script."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script:
        return ""
    return (f"; workers first import your script {Path(script).name}: if it calls pipetrain.train outside "
            "`if __name__ == \"__main__\":`, put the call under it")


def _silent(workdir: str, procs: list, after: float | None) -> tuple[int, float] | None:
    """The first running worker whose heartbeat is older than ``after`` seconds, and its age."""
    if after is None:
        return None
    now = time.time()
    for r, p in enumerate(procs):
        beat = _beat(workdir, r)
        if p.exitcode is None and beat.exists() and now - beat.stat().st_mtime > after:
            return r, now - beat.stat().st_mtime
    return None


def _with_history(error: PipetrainError, workdir: str) -> PipetrainError:
    """Attach the history records the workers streamed to ``workdir`` (the reporters' JSON lines)."""
    records = []
    for f in sorted(Path(workdir).glob("history*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # the last line of a worker killed while writing it
                pass
    error.history = sorted(records, key=lambda h: h["step"])
    return error


def loopback_store(rank: int, world: int, port: int, timeout: float) -> Any:
    """The rendezvous of locally launched workers: rank 0 serves it on 127.0.0.1 only (torch's own
    would listen on every interface).

    Raises:
        PipetrainError: the port was taken between picking it and binding it.
    """
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, wait)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        raise PipetrainError(f"port {port} {_PORT_TAKEN} ({e.strerror}): another program took it after pipetrain "
                             f"picked it, {PORT_TRIES} times; free some ports or run the job again") from None
    sock.listen()
    # detach: the store owns the listening socket from now on (a collected socket object would close it)
    return dist.TCPStore("127.0.0.1", port, world, True, wait, master_listen_fd=sock.detach())
