"""The link: a ping-pong through the runtime's own Transport between two processes, idle and busy."""
from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.launch import spawn
from pipetrain.runtime.transport import Message, Transport
from pipetrain.simulate import Link

from simreal.workload import Config


def _ping_pong(cfg: Config, sizes: list[int], rounds: int, busy: bool) -> dict[str, Any]:
    """Run as rank 0 or 1 of a 2-process gloo job: round trips through the runtime's Transport.

    With ``busy``, a thread in each process runs a microbatch-sized Linear forward and backward in a
    loop meanwhile, so both cores compute while messages cross, as in a running pipeline.
    """
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    tr = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, torch.device("cpu"), 60.0)
    stop = threading.Event()

    def compute() -> None:
        x, w = torch.randn(cfg.batch // cfg.micro, cfg.width), torch.randn(cfg.width, cfg.width, requires_grad=True)
        while not stop.is_set():
            (x @ w).sum().backward()

    if busy:
        threading.Thread(target=compute, daemon=True).start()
    tensors = {n: torch.zeros(n // 4) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cpu = dict.fromkeys(sizes, 0.0)
    mb = 0
    for k in range(rounds + 3):  # sizes interleaved, so a slow spell hits them all; 3 warm-up rounds
        for n in sizes:
            c0, t0 = time.process_time(), time.perf_counter()  # CPU of every thread of this process
            if rank == 0:
                tr.send(1, Message(mb, None, 0, [tensors[n]], False))
                tr.recv(1, mb, None, "pong")
            else:
                msg = tr.recv(0, mb, None, "ping")
                tr.send(0, Message(mb, None, 0, msg.tensors, False))
            if k >= 3:
                times[n].append(time.perf_counter() - t0)
                cpu[n] += time.process_time() - c0
            mb += 1
    # a round sends one message and receives one; with ``busy`` the computing thread's CPU counts too
    out: dict[str, Any] = {str(n): statistics.median(times[n]) / 2 for n in sizes}
    out.update({f"cpu {n}": None if busy else cpu[n] / rounds / 2 for n in sizes})
    stop.set()
    tr.close()
    return out


def measure_link(cfg: Config, cut_bytes: int) -> tuple[Link, dict[str, Any]]:
    """Link(bandwidth, latency) from one-way times (round trip / 2) of a 4 KB and a cut-sized message
    between two otherwise idle processes; also the one-way times of 4 KB, a microbatch's cut and a
    minibatch's cut with both cores computing, and the CPU a message costs each end."""
    small = 4096
    sizes = [small, cut_bytes // cfg.micro, cut_bytes]
    idle = spawn(_ping_pong, 2, (cfg, sizes, cfg.link_rounds, False))[0]
    busy = spawn(_ping_pong, 2, (cfg, sizes, cfg.link_rounds, True))[0]
    t_small, t_cut = idle[str(small)], idle[str(cut_bytes)]
    # a noisy small message may come out slower than the large one; then charge it all to bandwidth
    bandwidth = (cut_bytes - small) / (t_cut - t_small) if t_cut > t_small else cut_bytes / t_cut
    return Link(bandwidth, t_small), {"sizes": sizes, "one_way_idle_s": [idle[str(n)] for n in sizes],
                                      "one_way_busy_s": [busy[str(n)] for n in sizes],
                                      "cpu_per_message_end_s": [idle[f"cpu {n}"] for n in sizes]}
