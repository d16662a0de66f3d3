"""What one rank does from start to end: set up, train epoch by epoch, checkpoint, report.

:func:`run_rank` is the one entry point of a rank, whether ``pipetrain.train`` forked it or torchrun
started it, so both launch paths train alike. It builds the rank's worker from the validated
configuration and drives it epoch by epoch; what happens inside an epoch, action by action, is
:mod:`pipetrain.runtime.worker`'s.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipetrain.batches import epoch_order
from pipetrain.config import JobConfig
from pipetrain.runtime import checkpoint, multi, saving
from pipetrain.runtime.compiled import compile_stage
from pipetrain.runtime.dist import init_distributed, wire_device
from pipetrain.runtime.launch import keep_freed_memory
from pipetrain.runtime.tied import TiedCopies
from pipetrain.runtime.tied import edges as tied_edges
from pipetrain.runtime.loader import Inline, Loaders, Recipe
from pipetrain.runtime.logs import JsonLines, MetricsLog
from pipetrain.runtime.parts import Part, Source, build
from pipetrain.runtime.restore import load_named, named_state, optimized_names, restore
from pipetrain.runtime.outcome import RankResult
from pipetrain.runtime.resident import peak_resident
from pipetrain.runtime.transport import Channel, Transport
from pipetrain.runtime.weights import POLICIES
from pipetrain.runtime.worker import NonFiniteLoss, StepRecord, Worker
from pipetrain.schedule import evaluation, interleaved
from pipetrain.strategies.base import GradSync, SyncContext


@dataclass(frozen=True)
class Start:
    """Where one launch of a job begins.

    Attributes:
        attempt: how many times the job was restarted before this launch (0 at first).
        resume_from: the epoch every worker resumes after (from its checkpoint), or None: from scratch.
        began: ``time.perf_counter()`` when the run began: the metrics log's times count from it.
        board: ``log_dir`` gets TensorBoard files too (the caller found tensorboard installed).
    """

    attempt: int = 0
    resume_from: int | None = None
    began: float = 0.0
    board: bool = False

    @property
    def first_epoch(self) -> int:
        return 0 if self.resume_from is None else self.resume_from + 1


def run_rank(cfg: JobConfig, start: Start, parts: list[Part], source: Source) -> dict[str, Any]:
    """Build this rank's stages from ``parts`` (:mod:`pipetrain.runtime.parts`) and train them; return
    what it reports (:class:`RankResult`, as plain data)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prepare_process(cfg)
    device = init_distributed(cfg.run.timeout, cfg.run.backend)
    result = _shared(asdict(_train(cfg, start, rank, device, parts, source)), world)
    # only after success: teardown with a dead peer can block, and on failure the launcher
    # (ours or torchrun) stops every process anyway
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":
        dist.destroy_process_group()
    return result


def prepare_process(cfg: JobConfig) -> None:
    """Set this process up as a worker's: malloc keeps freed memory, ``cfg.threads`` torch threads (and
    inductor's compilation in one), torch's random generator seeded with the job's seed."""
    keep_freed_memory()  # also under torchrun, which starts the process
    torch.set_num_threads(cfg.threads)
    if cfg.training.compile:  # the workers share the cores: each compiles in its own process, with no pool of them
        import torch._dynamo.config as dynamo  # noqa: PLC0415 - only where compile is asked for
        import torch._inductor.config as inductor  # noqa: PLC0415

        inductor.compile_threads = 1
        # stages of one kind share their forward's code, whose graphs dynamo caches up to a limit before
        # running it eagerly: room for each stage a process may hold (interleaved) and its few variants
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * cfg.layout.num_stages)
    torch.manual_seed(cfg.training.seed)


def build_worker(cfg: JobConfig, rank: int, device: torch.device, transport: Channel, sync: GradSync | None,
                 stage: nn.Module, start: Start = Start(), exchange_ties: bool = True,
                 aliases: Mapping[str, tuple[str, ...]] | None = None, layers: tuple[int, int] | None = None) -> Worker:
    """``rank``'s worker as the job runs it, around ``stage`` (built on ``device``: its stage, the whole
    model for data parallelism), ``transport`` and ``sync``: its optimizer and weight policy, restored
    from the checkpoint of the epoch ``start`` resumes after, if any, by the model's names, whatever
    the layout that saved it (``aliases``: every name of each tied parameter;
    :mod:`pipetrain.runtime.restore`). For a looped schedule ``rank`` is the stage, as if it had a
    worker of its own. With ``exchange_ties`` False, a stage's copy of a tied parameter trains on its
    own (a worker run alone, for its timings). With ``compile`` the stage (its ``layers``, first and
    last; None: the whole model) is compiled in place before anything wraps it."""
    t, layout = cfg.training, cfg.layout
    stage_idx = layout.stage_of(rank)
    if t.compile:
        compile_stage(stage, f"the model ({layout.name(rank)})" if layers is None else
                      f"stage {stage_idx} (layers {layers[0]}-{layers[1]})")
    tied = TiedCopies(stage, cfg.ties, layout, rank, transport) \
        if exchange_ties and any(stage_idx in tie.stages for tie in cfg.ties) else None
    borrowed = tied.borrowed if tied is not None else set()
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad and n not in borrowed]
    optimizer = t.optimizer([p for _, p in named]) if named else None
    scheduler = t.lr_scheduler(optimizer) if optimizer is not None and t.lr_scheduler is not None else None
    version, history = 0, []
    if start.resume_from is not None:
        assert cfg.run.checkpoint_dir is not None
        names = [n for n, _ in named]
        state = restore(cfg.run.checkpoint_dir, start.resume_from, rank, stage, names, aliases or {},
                        history=rank == layout.first_reporter)
        stage.load_state_dict(state.model)
        if optimizer is not None:
            load_named(optimizer, state.optimizer, names)
        if scheduler is not None:
            scheduler.load_state_dict(state.scheduler)
        version, history = state.version, state.history
        _set_rng(state.rng, device)  # dropout and the like go on as if never stopped: [Note: resume by name]
    policy = POLICIES[cfg.policy_name(stage_idx)](stage, tied.names if tied is not None else ())
    policy.version = version
    if tied is not None:
        tied.start(version)
    reporter = layout.reporter(rank)
    worker = Worker(rank, sync.wrap(stage) if sync else stage, policy, optimizer, transport, Inline(_recipe(cfg)),
                    t.loss_fn, t.batch_size, device, grad_sync=sync, trace=[] if cfg.run.trace else None,
                    shard=(layout.replica_of(rank), layout.replicas[stage_idx]) if cfg.data_parallel else (0, 1),
                    name=layout.name(rank), attempt=start.attempt,
                    log=_history_log(rank) if reporter else None, scheduler=scheduler,
                    clip_grad_norm=t.clip_grad_norm, precision=t.precision, recompute=t.recompute,
                    metrics_log=_metrics_log(cfg, rank, start) if cfg.run.log_dir and reporter else None, tied=tied,
                    fixed_shapes=not cfg.data_parallel, compiled=t.compile)
    worker.history = [StepRecord(**h) for h in history]
    worker.footprint.samples = [] if cfg.run.trace else None
    return worker


def _metrics_log(cfg: JobConfig, rank: int, start: Start) -> MetricsLog:
    """A reporter's side of ``log_dir``; the first reporter alone writes TensorBoard's curves."""
    assert cfg.run.log_dir is not None
    first_step = start.first_epoch * cfg.training.epoch_minibatches(cfg.layout.rounds) + 1
    again = start.resume_from is not None or start.attempt > 0
    return MetricsLog(cfg.run.log_dir, start.began, start.board and rank == cfg.layout.first_reporter,
                      first_step if again else None, cfg.training.steps(cfg.layout.rounds), cfg.data_parallel)


def _recipe(cfg: JobConfig) -> Recipe:
    t = cfg.training
    return Recipe(t.dataset, t.eval_dataset, t.seed, t.target_key, t.collate_fn)


def _train(cfg: JobConfig, start: Start, rank: int, device: torch.device, parts: list[Part],
           source: Source) -> RankResult:
    """Build the rank's stages (one, or several for a looped schedule: each with its own Worker, built
    as if it were rank s of a straight pipeline), then train them epoch by epoch."""
    t, layout, world = cfg.training, cfg.layout, cfg.world
    edges = multi.edges(layout.num_stages, world) if cfg.looped else \
        sorted(set(layout.edges()) | set(tied_edges(cfg.ties, layout)))
    transport = Transport(rank, edges, cfg.worker_name, device, cfg.run.timeout)
    sync = None if cfg.looped else cfg.strategy.synchronizer(SyncContext(rank, layout, device, cfg.run.timeout))
    workers: dict[int, Worker] = {}
    modules: dict[int, nn.Module] = {}
    for part in parts:
        key = part.stage if cfg.looped else rank  # a looped stage's Worker runs as rank = its stage
        modules[key] = build(part, source, device)
        channel = multi.StageChannel(transport, part.stage, world) if cfg.looped else transport
        workers[key] = build_worker(cfg, key, device, channel, sync, modules[key], start, aliases=source.aliases,
                                    layers=part.layers)
        if cfg.run.loader_workers and part.stage in (0, layout.num_stages - 1):  # a middle stage reads no data
            workers[key].source = Loaders(_recipe(cfg), cfg.run.loader_workers, cfg.run.prefetch, cfg.run.timeout,
                                          pin=device.type == "cuda")
    if cfg.looped:
        for s, worker in workers.items():
            worker.name, worker.trace = f"stage {s} (rank {rank})", None
    runner: Worker | multi.LocalStages = multi.LocalStages(rank, workers, [] if cfg.run.trace else None) \
        if cfg.looped else workers[rank]
    ready = time.perf_counter()
    k = t.epoch_minibatches(layout.rounds)
    bar = _progress(cfg, rank, t.steps(layout.rounds, start.first_epoch))
    # the bar's rank records its own minibatches: every one (data parallel, looped), or 1 in r (one of
    # the r replicas of the output stage)
    per_record = 1 if cfg.data_parallel or cfg.looped else layout.replicas[-1]
    # the postfix waits for the bar's next redraw (tqdm's mininterval): redrawing it after every
    # minibatch would cost a fast model a noticeable share of its step
    on_step = (lambda rec: bar.set_postfix(loss=f"{rec.loss:.4f}", refresh=False) or bar.update(per_record)) \
        if bar else None
    for epoch in range(start.first_epoch, t.epochs):
        batches = t.order(epoch, layout.rounds)
        if not batches:  # max_steps reached
            break
        try:
            runner.run_epoch(cfg.schedule_for(epoch, len(batches)), epoch, batches, epoch * k, on_step)
        except NonFiniteLoss as e:
            kept = epoch - 1 if cfg.run.checkpoint_dir and epoch > 0 else None
            where = f"the checkpoint of epoch {kept} in {cfg.run.checkpoint_dir} is kept" if kept is not None \
                else "no checkpoint was saved"
            raise NonFiniteLoss(f"{e}; training stopped, {where}; lower the learning rate") from None
        if cfg.data_parallel:
            _mean_losses(runner.history[-len(batches):], world, device)
            if runner.metrics_log is not None:
                runner.metrics_log.updates([asdict(r) for r in runner.history[-len(batches):]])
            agree_buffers(modules[rank], world)
        if t.eval_dataset is not None:
            scores = _evaluate(cfg, runner, epoch, device, (epoch + 1) * k)
            if bar:
                bar.write(f"epoch {epoch}: held-out " + ", ".join(f"{name} {v:.4g}" for name, v in scores.items()))
        for key, worker in workers.items() if cfg.run.checkpoint_dir else ():
            _save(cfg, key, epoch, worker, modules[key], device)
    if bar:
        bar.close()
    for worker in workers.values():
        worker.source.close()
        if worker.log is not None:
            worker.log.close()
        if worker.metrics_log is not None:
            worker.metrics_log.close()
    if sync:
        sync.close()
    transport.close()
    report = _report(cfg, rank, device, ready, runner, workers, modules,
                     transport.bytes_sent + (sync.bytes_sent if sync else 0), sync.stats() if sync else {})
    report.writing = time.perf_counter()
    report.saved = _write(cfg, rank, workers, modules, source) if cfg.run.save is not None else {}
    return report


def _write(cfg: JobConfig, rank: int, workers: dict[int, Worker], modules: dict[int, nn.Module],
           source: Source) -> dict[str, list[str]]:
    """Write the shards of ``save`` this rank holds: each stage's first worker its stage's (data
    parallelism: worker 0 the whole model); a ``torch.save`` file is the caller's to write."""
    assert cfg.run.save is not None
    if saving.gathered_only(cfg.run.save) or not cfg.looped and cfg.layout.replica_of(rank) != 0:
        return {}
    out: dict[str, list[str]] = {}
    for key, worker in workers.items():
        borrowed = worker.tied.borrowed if worker.tied is not None else set()
        out.update(saving.write_stage(cfg.run.save, cfg.layout.stage_of(key), cfg.layout.num_stages,
                                      modules[key].state_dict(), borrowed, source.aliases))
    return out


def _report(cfg: JobConfig, rank: int, device: torch.device, ready: float, runner: Worker | multi.LocalStages,
            workers: dict[int, Worker], modules: dict[int, nn.Module], bytes_sent: int,
            sync_stats: dict[str, Any]) -> RankResult:
    """What ``rank`` reports of its run. Data-parallel workers hold the same model: rank 0's comes
    back, the others' digests."""
    # only what is gathered or compared: a meta model's pipeline stage on a GPU is never copied to the host
    state = {k: v.detach().cpu() for m in modules.values() for k, v in m.state_dict().items()} \
        if cfg.gathers or cfg.data_parallel else {}
    footprints = [w.footprint.report() for w in workers.values()]
    return RankResult(
        rank=rank, digest=_digest(state) if cfg.data_parallel else None,
        state=state if cfg.gathers and (not cfg.data_parallel or rank == 0) else {},
        history=[asdict(h) for h in runner.history] if cfg.looped or cfg.layout.reporter(rank) else [],
        trace=runner.trace or [],
        # a rank holding several stages: its stages' own peaks added up, at most what it held at once
        stashed_bytes={key: sum(f[key] for f in footprints) for key in ("activation_bytes", "weight_bytes")},
        memory_trace=(workers[rank].footprint.samples or []) if not cfg.looped else [],
        bytes_sent=bytes_sent, sync_stats=sync_stats, ready=ready,
        weight_versions=max(w.policy.peak_versions for w in workers.values()), peak_memory=peak_resident(),
        peak_device_memory=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)


def _save(cfg: JobConfig, rank: int, epoch: int, worker: Worker, stage: nn.Module, device: torch.device) -> None:
    """Checkpoint ``rank``'s worker (of a looped schedule: the stage's, ``rank`` being the stage) after ``epoch``."""
    assert cfg.run.checkpoint_dir is not None
    optimizer = worker.optimizer
    checkpoint.save(cfg.run.checkpoint_dir, rank, epoch, {
        "model": stage.state_dict(),
        "optimizer": named_state(optimizer, optimized_names(optimizer, stage)) if optimizer else {},
        "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else {},
        "epoch": epoch, "version": worker.policy.version, "rng": _rng(device),
        "history": [asdict(h) for h in worker.history] if cfg.layout.reporter(rank) else []},
        cfg.identity(), keep=cfg.run.keep_checkpoints)


def _shared(result: dict[str, Any], world: int) -> dict[str, Any]:
    """This rank's part; under torchrun every rank gets every rank's part."""
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, result)
        return {"parts": parts}
    return result


def _evaluate(cfg: JobConfig, worker: Worker | multi.LocalStages, epoch: int, device: torch.device,
              step: int) -> dict[str, float]:
    """Evaluate on the job's ``eval_dataset`` at the end of ``epoch`` (every rank takes part): whole minibatches
    in dataset order, forward only through the stages (each replica its round-robin share; data
    parallelism: each worker its shard). Returns the means over the samples of the loss and each metric,
    recorded with the epoch's last update (``step``) and in the metrics log."""
    t = cfg.training
    assert t.eval_dataset is not None
    metrics = t.metrics or {}
    batches = epoch_order(t.n_eval_items, t.batch_size, 0, False, 0, 1)
    schedule = interleaved.evaluation(cfg.world, cfg.layout.num_stages, len(batches), cfg.microbatches) \
        if cfg.looped else evaluation(cfg.layout.replicas, len(batches), cfg.data_parallel, cfg.microbatches)
    sums = torch.tensor(worker.evaluate(schedule, batches, metrics), dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums)  # the output stage's sums (every data-parallel worker's shards) reach every rank
    means = (sums[:-1] / sums[-1]).tolist()
    scores = dict(zip(["loss", *metrics], means))
    # the replica of the output stage that made the epoch's last update
    made = next((record for record in worker.history[::-1] if record.step == step), None)
    if made is not None:
        made.eval = scores
    if worker.metrics_log is not None:
        worker.metrics_log.evaluation(epoch, step, scores, jsonl=made is not None)
    return scores


def _mean_losses(records: list[StepRecord], world: int, device: torch.device) -> None:
    """Each data-parallel worker saw the loss of its shard; record the minibatch's (the mean over
    shards of equal size) with one allreduce per epoch, not one per step."""
    losses = torch.tensor([r.loss for r in records], dtype=torch.float64, device=device)
    dist.all_reduce(losses)
    for r, value in zip(records, (losses / world).tolist()):
        r.loss = value


def agree_buffers(module: nn.Module, world: int) -> None:
    """Make every floating-point buffer (BatchNorm's running statistics) the mean over the data-parallel
    workers, added in rank order, so it is bitwise the same on each.

    Each worker updates those buffers from its own shard, so they drift apart; every epoch's end (before
    its checkpoint) they are averaged: the mean of the shards' statistics estimates the whole
    minibatches'. (PyTorch DDP instead copies rank 0's at every forward.) Integer buffers (batch
    counts) are the same on every worker already."""
    if world == 1:
        return
    for buf in module.buffers():
        if buf.is_floating_point():
            mine = buf.detach().contiguous().to(wire_device(buf.device))  # gloo gathers host tensors only
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            total = parts[0]
            for part in parts[1:]:
                total.add_(part)
            buf.copy_(total.div_(world))


def _digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's bytes: equal digests mean bitwise equal weights."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _progress(cfg: JobConfig, rank: int, total: int) -> Any:
    if not cfg.run.progress or rank != (0 if cfg.data_parallel else cfg.world - 1):
        return None
    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock leaks on a hard exit
    return tqdm(total=total, desc="pipetrain", unit="batch", dynamic_ncols=True)


def _rng(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state (CPU, and the GPU's when the worker has one)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _history_log(rank: int) -> JsonLines | None:
    """Where a locally launched reporter streams its history, so a failed run keeps it."""
    workdir = os.environ.get("PIPETRAIN_WORKDIR")
    return JsonLines(Path(workdir) / f"history{rank}.jsonl") if workdir else None
