"""Start local worker processes, or run as one rank under torchrun.

Locally, workers are forked from a fork server: a clean process that has imported torch,
``torch._dynamo`` (which building the first optimizer imports, 1.5-2 s) and pipetrain, and has run
nothing, so no thread pool or CUDA context is forked. The caller itself is never forked (its thread
pools would not survive it), so, as with spawn, arguments must pickle; objects defined at module level
of the caller's script do. A worker then starts in about 0.1 s instead of 3-5 s (measured on a 2-core
machine; the first job of a process also starts the server, about 3 s). When one worker fails, the
others are stopped at once and the first failure's one-line message is raised in the caller.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class PipetrainError(RuntimeError):
    """A job failed; the message says which worker and why."""


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
    the pipe close and exits too. The parent-death signal covers the fork server itself dying.
    """
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        fd = os.pidfd_open(caller)
    except (OSError, AttributeError):
        return
    import select
    import threading

    def watch() -> None:
        select.select([fd], [], [])  # readable once the caller has exited
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="pipetrain-caller-watch").start()


def keep_freed_memory() -> None:
    """Tell glibc's malloc to serve large blocks from its heap and keep what is freed, so the next
    step reuses it.

    [Note: page faults] By default glibc maps every block over 32 MiB fresh and unmaps it when freed,
    so a training step page-faults through each large gradient, activation and optimizer temporary
    again (the kernel also zeroes every page). On the 2-core machine here, vgg-like's forward and
    backward on 16 samples took 193 ms by default and 134 ms with these settings, copying its 107 MB
    gradient 58 and 11 ms, an SGD step 18 and 10 ms. The cost: a worker holds on to its peak memory,
    as a caching allocator does. Elsewhere than glibc this does nothing.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: blocks up to 1 GiB come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed memory
    except (OSError, AttributeError):
        pass


def _child(rank: int, world: int, port: int, workdir: str, payload: bytes, caller: int) -> None:
    _die_with_caller(caller)
    keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), PIPETRAIN_SPAWNED="1")
    code = 0
    try:
        fn, args = pickle.loads(payload)
        torch.save(fn(*args), Path(workdir) / f"result{rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then the process ends
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, PipetrainError) else str(e)
        (Path(workdir) / f"error{rank}.txt").write_text(msg.strip().splitlines()[0] + "\n" + traceback.format_exc())
        code = 1
    # [Note: hard exit] communication threads may sit in a blocking recv on a dead peer; a normal
    # interpreter exit would wait on process-group teardown, so leave without it.
    os._exit(code)


def spawn(fn: Callable[..., Any], world: int, args: tuple, describe: Callable[[int], str] = "rank {}".format,
          poll_s: float = 0.05) -> list[Any]:
    """Run ``fn(*args)`` in ``world`` processes with RANK/WORLD_SIZE set; return each rank's result.

    Results travel through ``torch.save``/``torch.load(weights_only=True)``: plain data and tensors.

    Raises:
        PipetrainError: a worker raised (its first line is the message) or died.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "pipetrain"])  # once per caller process
    port = _free_port()
    # [Note: pickle by value] multiprocessing pickles Process arguments with torch's reducers, which
    # move tensors to shared memory: every worker, and the caller's model, would then update one
    # copy of the weights. Plain pickle gives each worker its own copy.
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory(prefix="pipetrain-") as workdir:
        procs = [ctx.Process(target=_child, args=(r, world, port, workdir, payload, os.getpid()), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            while any(p.exitcode is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise PipetrainError(_failure(workdir, failed, procs, describe))
                time.sleep(poll_s)
            failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
            if failed:
                raise PipetrainError(_failure(workdir, failed, procs, describe))
            return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=True) for r in range(world)]
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join(10)


# What a worker says when a peer is gone: ours, and gloo's for a closed connection.
_COMPLAINTS = ("went silent", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _failure(workdir: str, failed: list[int], procs: list, describe: Callable[[int], str]) -> str:
    """The message of the most telling failure: a worker's own error, then a worker that died
    without one (killed, crashed), then a neighbour's complaint about a lost peer."""
    messages, rank = {}, {}
    for r in failed:
        f = Path(workdir) / f"error{r}.txt"
        if f.exists():
            messages[r] = f.read_text().splitlines()[0]
            rank[r] = 2 if any(c in messages[r] for c in _COMPLAINTS) else 0
        else:
            messages[r], rank[r] = f"{describe(r)} died with exit code {procs[r].exitcode}", 1
    return messages[min(failed, key=lambda r: (rank[r], r))]
