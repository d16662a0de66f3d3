"""Where Pipe-SGD's ring allreduce spends its time and CPU, beside gloo's own collectives.

    flock /tmp/pipetrain-bench.lock python benchmarks/ring_costs.py [--link 10gbit] [--model vgg-like] [--json F]

Two emulated hosts (:class:`pipetrain.bench.cluster.EmulatedCluster`, one rank each, one torch thread,
as ``pipetrain bench`` runs them) reduce the model's whole gradient (vgg-like: 27M floats, 107 MB)
again and again. Each row is the median of ``--repeats`` after one warm-up, every repeat started by a
barrier; rank 0's figures:

* ``wall``: seconds the call took; ``thread cpu``: CPU seconds of the calling thread
  (``time.thread_time``); ``process cpu``: CPU seconds of the whole process meanwhile (its every thread,
  gloo's included, and the kernel's network work done on their behalf); ``machine cpu``: busy CPU
  seconds of the whole machine meanwhile (both ranks, the emulated link's kernel work, anything else).

The rows: the copy of the gradient into the sync's buffer, and a mean with a copy back out (the
passes over the gradient around an allreduce: Pipe-SGD's ``A`` now divides on its copy, DDP divides
and copies back); one hop of half the gradient each way, sent whole and in the ring's
chunks (the link's floor); the ring's two phases run apart (reduce-scatter: send, receive and add one
block; all-gather: send and receive one block); the ring as Pipe-SGD runs it, per codec; gloo's
``all_reduce`` of the same buffer whole and in DDP's 25 MB buckets, and its ``reduce_scatter`` +
``all_gather``.

Then what decides whether Pipe-SGD's K = 2 can hide its allreduce: the training loop of one worker
(forward + backward of its half of the batch, then Pipe-SGD's ``A``, ``S`` and SGD step through
:class:`pipetrain.strategies.pipesgd.RingSync`, without the runtime around it) at K = 1 and K = 2,
beside the same loop with no sync at all, each with the whole machine's busy CPU per step: where K = 1
already keeps the cores busy, K = 2 has no idle CPU to hide the allreduce in. The lossless loops run
twice: with gloo's ``all_reduce`` (what pipe-sgd runs) and with the ring.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.bench.cluster import EmulatedCluster
from pipetrain.bench.load import machine_busy_s
from pipetrain.bench.measure import PeerConfig, batches, init_group
from pipetrain.strategies import pipesgd
from pipetrain.strategies.compression import get_codec
from pipetrain.strategies.pipesgd import RingSync
from pipetrain.strategies.ring import block_size, ring_allreduce

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket (``bucket_cap_mb=25``)."""


def _process_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` (after one warm-up) of wall, thread, process and machine CPU seconds."""
    rows: list[tuple[float, float, float, float]] = []
    for _ in range(repeats + 1):
        dist.barrier()
        w, t, p, m = time.perf_counter(), time.thread_time(), _process_cpu(), machine_busy_s()
        fn()
        rows.append((time.perf_counter() - w, time.thread_time() - t, _process_cpu() - p, machine_busy_s() - m))
    keys = ("wall_s", "thread_cpu_s", "process_cpu_s", "machine_cpu_s")
    return {k: statistics.median(r[i] for r in rows[1:]) for i, k in enumerate(keys)}


def _hop(send: torch.Tensor, recv: torch.Tensor, peer: int, chunk: int | None) -> list[Any]:
    """Send ``send`` to ``peer`` and receive ``recv`` from it, whole or in ``chunk``-byte pieces."""
    s, r = send.view(torch.uint8), recv.view(torch.uint8)
    step = chunk or s.numel()
    ops = []
    for i in range(0, s.numel(), step):
        ops += [dist.P2POp(dist.isend, s[i:i + step], peer), dist.P2POp(dist.irecv, r[i:i + step], peer)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def rank_costs(cfg: PeerConfig, repeats: int, steps: int) -> dict[str, Any]:
    """One rank of the measurements (module docstring); two ranks only."""
    rank, world = init_group(cfg)
    if world != 2:
        raise ValueError(f"ring_costs runs on 2 ranks, got {world}")
    peer = 1 - rank
    model = cfg.build()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) for p in params]
    n = sum(g.numel() for g in grads)
    b = block_size(n, world, 1)
    buf = torch.zeros(world * b)
    blocks = buf.view(world, b)
    recv = torch.zeros(b)
    chunk = 1 << 20
    held: dict[str, dict[str, torch.Tensor]] = {"none": {}, "trunc16": {}, "quant8": {}}
    group = dist.new_group([0, 1])
    rows: dict[str, dict[str, float]] = {}

    def copy_in() -> None:
        torch.cat([g.reshape(-1) for g in grads], out=buf[:n])

    def copy_out() -> None:
        buf.div_(world)
        off = 0
        for g in grads:  # what U reads through the lent views; one read of the buffer
            g.view(-1).copy_(buf[off:off + g.numel()])
            off += g.numel()

    def ring(codec: str | None) -> Callable[[], None]:
        c = get_codec(codec)
        bb = block_size(n, world, c.granule)
        data = torch.randn(world * bb).view(world, bb)
        return lambda: ring_allreduce(data, group, c, held[c.name])

    def rs_phase() -> None:
        _wait(_hop(blocks[rank], recv, peer, chunk))
        blocks[peer].add_(recv)

    def ag_phase() -> None:
        _wait(_hop(blocks[peer], blocks[rank], peer, chunk))

    def gloo_buckets() -> None:
        step = BUCKET_BYTES // 4
        works = [dist.all_reduce(buf[i:i + step], async_op=True) for i in range(0, buf.numel(), step)]
        _wait(works)

    def gloo_rs_ag() -> None:
        dist.reduce_scatter_tensor(recv, buf)
        dist.all_gather_into_tensor(buf, recv)

    rows["copy in (cat grads -> buffer)"] = _timed(copy_in, repeats)
    rows["mean + copy out"] = _timed(copy_out, repeats)
    rows["one hop, whole (link floor)"] = _timed(lambda: _wait(_hop(blocks[rank], recv, peer, None)), repeats)
    rows["one hop, 1 MiB chunks"] = _timed(lambda: _wait(_hop(blocks[rank], recv, peer, chunk)), repeats)
    rows["ring reduce-scatter alone"] = _timed(rs_phase, repeats)
    rows["ring all-gather alone"] = _timed(ag_phase, repeats)
    for codec in (None, "trunc16", "quant8"):
        rows[f"ring allreduce, {codec or 'none'}"] = _timed(ring(codec), repeats)
    rows["gloo all_reduce, whole"] = _timed(lambda: dist.all_reduce(buf), repeats)
    rows["gloo all_reduce, 25 MB buckets"] = _timed(gloo_buckets, repeats)
    try:
        rows["gloo reduce_scatter + all_gather"] = _timed(gloo_rs_ag, repeats)
    except RuntimeError as e:  # a gloo build without reduce_scatter_tensor
        print(f"rank {rank}: gloo reduce_scatter + all_gather: {str(e).splitlines()[0]}", file=sys.stderr)
    loops = {"no sync (compute alone)": _loop(cfg, model, group, None, 0, steps)}
    for codec in (None, "quant8"):
        for k in (1, 2):
            loops[f"pipe-sgd {codec or 'none'} K={k}"] = _loop(cfg, model, group, codec, k, steps)
    # the same loop with the ring for the identity codec too, as pipe-sgd ran before it used gloo's own
    # all_reduce there ([Note: lossless allreduce] in pipetrain.strategies.ring)
    pipesgd.allreduce = ring_allreduce
    for k in (1, 2):
        loops[f"pipe-sgd none K={k}, ring"] = _loop(cfg, model, group, None, k, steps)
    return {"rank": rank, "elements": n, "rows": rows, "loops": loops}


def _loop(cfg: PeerConfig, model: torch.nn.Module, group: dist.ProcessGroup, codec: str | None, staleness: int,
          steps: int) -> dict[str, float]:
    """Pipe-SGD's loop as a job's worker runs it, without the runtime around it: forward + backward of
    this rank's shard, ``A`` (:class:`RingSync`'s start), ``S`` of the minibatch K - 1 before (its wait)
    and the SGD step; staleness 0: the same without any sync, what the machine computes alone. Per
    step after two warm-up steps: seconds, this thread's and this process's CPU seconds, and the whole
    machine's busy CPU seconds."""
    data = batches(cfg, cfg.batch_size // dist.get_world_size(), seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    weights = dict(model.named_parameters())
    sync = RingSync(group, dist.get_world_size(), get_codec(codec), torch.device("cpu"), cfg.timeout_s) \
        if staleness else None
    first = 2
    for i in range(first + steps):
        if i == first:
            dist.barrier()
            w, t, p, m = time.perf_counter(), time.thread_time(), _process_cpu(), machine_busy_s()
        x, y = data[i % len(data)]
        cfg.spec.loss_fn(model(x), y).backward()
        if sync is not None:
            sync.start(i, weights)
            if i < staleness - 1:
                continue
            sync.wait(i - staleness + 1, weights)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {"step_s": time.perf_counter() - w, "thread_cpu_s": time.thread_time() - t,
           "process_cpu_s": _process_cpu() - p, "machine_cpu_s": machine_busy_s() - m}
    if sync is not None:  # drain: the last K - 1 minibatches' allreduces, untimed
        for j in range(first + steps - staleness + 1, first + steps):
            sync.wait(j, weights)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync.close()
    return {k: v / steps for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", action="append", help="emulated link rate(s) (default 10gbit and 1gbit)")
    ap.add_argument("--model", default="vgg-like")
    ap.add_argument("--batch-size", type=int, default=32, help="of the whole job; each rank computes half")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each training loop")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    # the ranks import this module by name: it must not be __main__
    sys.path.insert(0, str(Path(__file__).parent))
    me = importlib.import_module(Path(__file__).stem)
    cfg = PeerConfig(model=args.model, batch_size=args.batch_size)
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {"model": args.model, "batch_size": args.batch_size, "links": {}}
    for link in args.link or ["10gbit", "1gbit"]:
        with EmulatedCluster(2, link=link, subnet="10.214.7") as hosts:
            res = hosts.spawn(me.rank_costs, (cfg, args.repeats, args.steps), port=29611, timeout=900)[0]
        out["links"][link] = res
        print(f"\n{args.model}, {res['elements'] * 4 / 1e6:.0f} MB of float32 gradient, 2 hosts at {link} "
              f"(rank 0; medians of {args.repeats})")
        print("| operation | wall ms | thread cpu ms | process cpu ms | machine cpu ms |")
        print("|---|---|---|---|---|")
        for name, r in res["rows"].items():
            print(f"| {name} | {r['wall_s'] * 1e3:.0f} | {r['thread_cpu_s'] * 1e3:.0f} | "
                  f"{r['process_cpu_s'] * 1e3:.0f} | {r['machine_cpu_s'] * 1e3:.0f} |")
        print(f"\nthe training loop, per step (machine busy: machine cpu / ({cores} cores x step))")
        print("| loop | samples/s | step ms | thread cpu ms | process cpu ms | machine cpu ms | machine busy |")
        print("|---|---|---|---|---|---|---|")
        for name, r in res["loops"].items():
            print(f"| {name} | {args.batch_size / r['step_s']:.1f} | {r['step_s'] * 1e3:.0f} | {r['thread_cpu_s'] * 1e3:.0f} | "
                  f"{r['process_cpu_s'] * 1e3:.0f} | {r['machine_cpu_s'] * 1e3:.0f} | "
                  f"{r['machine_cpu_s'] / (cores * r['step_s']):.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
