"""``pipetrain.train``: validate, start the workers (or join torchrun), gather the trained model."""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.errors import PipetrainError, one_line, warn
from pipetrain.layers import LayerError, LayeredModel
from pipetrain.planning import Plan, check_fits, plan
from pipetrain.planning.choose import Choice, choose_strategy, predict_plan
from pipetrain.planning.units import parse_bandwidth
from pipetrain.profiling import Profile, as_minibatch, profile_model, time_batching
from pipetrain.registry import DEFAULT_SCHEDULE, SCHEDULES, STRATEGIES, lookup
from pipetrain.runtime import checkpoint
from pipetrain.runtime.dist import init_distributed
from pipetrain.runtime.job import JobConfig, describe, metrics_log, run_rank
from pipetrain.runtime.launch import spawn, under_torchrun
from pipetrain.runtime.worker import collate_parts, per_epoch
from pipetrain.setup import measure_setup, model_step
from pipetrain.timing import torch_threads
from pipetrain.simulate import Link


@dataclass
class TrainResult:
    """What a run gives back.

    Attributes:
        model: the trained full model (gathered from all stages of a pipeline), same structure as the
            input model.
        history: one record per optimizer step of the output stage (of worker 0 for data parallelism,
            with the minibatch's loss: the mean over the workers' shards): ``step``, ``epoch``, ``loss``,
            ``samples`` and ``samples_per_s`` (those samples over the time since the previous step),
            ``time`` (the output stage's perf_counter), ``lr`` (the learning rate the update used) and
            ``eval`` (with ``eval_dataset``, on each epoch's last record: the mean ``loss`` and metrics).
        samples_per_s: samples trained per second, measured at the output stage: every epoch from its
            start to its last update, not the evaluation, checkpoints and bookkeeping between epochs
            (:func:`training_rate`).
        traces: per rank, ``(action, start, end)`` records when ``trace=True`` (perf_counter seconds).
        plan: the plan that placed the stages, when one did (``"auto"``, a Plan or a plan file).
        predicted_samples_per_s: what pipetrain predicted for this run: with ``stages="auto"`` (or
            ``strategy="auto"``) the simulated run from the measured profile and set-up; with a plan
            given, batch size / its slowest stage's time.
        bytes_sent: per rank, tensor bytes it sent to other workers (activations, gradients, and its
            share of an allreduce: counted for pipe-sgd's ring, estimated as a ring's 2(r-1)/r of the
            gradient for a replicated stage and DDP).
        sync_stats: per rank, what its gradient synchronizer measured or decided: pipe-sgd's
            ``ring_seconds`` (each ring allreduce on the communication thread), cgdp's ``chunks``
            (the chunk size of every iteration) and ``search`` (the run-time chunk search).
        started: ``time.perf_counter()`` when ``train`` was called; on one machine it shares the clock
            of the history's ``time`` (so ``h["time"] - started`` is wall time since the call).
        restarts: one record per automatic restart (``max_restarts``): ``attempt`` that failed,
            ``error``, ``resumed_after_epoch`` (None: from scratch), ``redone_steps`` (updates the
            failed attempt made after that epoch, trained again) and ``time`` (perf_counter, when
            the failure was seen).
        epochs_trained: epochs this call trained (0 when a resumed job had nothing left to train).
        choice: with ``strategy="auto"``: ``{"choice": NAME, "predictions": {NAME: samples/s}, "options",
            "skipped", "reason"}`` (:meth:`pipetrain.planning.choose.Choice.to_dict`).
    """

    model: nn.Module
    history: list[dict[str, Any]]
    samples_per_s: float
    traces: list[list[tuple[str, float, float]]] = field(default_factory=list)
    plan: Plan | None = None
    predicted_samples_per_s: float | None = None
    started: float = 0.0
    bytes_sent: list[int] = field(default_factory=list)
    sync_stats: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    epochs_trained: int = 0
    choice: dict[str, Any] | None = None


def train(model: nn.Module, dataset: Dataset, *, loss_fn: Callable[[Any, Any], torch.Tensor],
          optimizer: Callable[..., torch.optim.Optimizer], strategy: str = "pipeline",
          stages: Sequence[int | str] | Plan | str | os.PathLike | None = None, workers: int | None = None,
          bandwidth: float | str | None = None, schedule: str | None = None, vertical_sync: bool = False,
          microbatches: int = 1, staleness: int | None = None, compression: str | None = None,
          warmup_epochs: int = 0, chunk: int | str | None = None, batch_size: int = 32, epochs: int = 1, shuffle: bool = True, seed: int = 0,
          checkpoint_dir: str | os.PathLike | None = None, resume: bool = False,
          keep_checkpoints: int | None = 2, max_restarts: int = 0, timeout: float = 300.0,
          threads: int | None = None, trace: bool | str | os.PathLike = False,
          progress: bool = False, allow_compression: bool = False,
          lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, clip_grad_norm: float | None = None,
          eval_dataset: Dataset | None = None, metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
          precision: str = "fp32", log_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train ``model`` on ``dataset`` with several worker processes.

    Args:
        model: the model. For ``strategy="pipeline"`` an ``nn.Sequential`` or a ``torch.fx``-traceable
            module (it is cut into layers); the data-parallel strategies take any module.
        dataset: a map-style dataset of ``(input, target)`` pairs.
        loss_fn: ``loss_fn(output, target)`` of a minibatch; mean-reduced for microbatching and sharding.
        optimizer: a factory taking parameters, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
        strategy: ``"auto"``: profile the model, measure this machine's set-up, predict every strategy's
            samples/s for ``workers`` (at ``bandwidth``, else over the measured transport), print the
            table, and train with the fastest (:func:`pipetrain.planning.choose_strategy`; ``result.choice``
            records it and every prediction). Or ``"pipeline"`` (stages on workers, run by ``schedule``), ``"ddp"`` (PyTorch
            DistributedDataParallel), ``"pipe-sgd"`` (Pipe-SGD: the allreduce of minibatch t overlaps
            the compute of the next K-1, in a ring that may compress) or ``"cgdp"`` (CPU-GPU data
            parallel: chunks of layers summed in shared host memory while the backward goes on); see
            :data:`pipetrain.registry.STRATEGIES`.
        stages: pipeline: the first layer index of each stage (one worker each), or the submodule each
            later stage begins at (``["transformer.h.2", "transformer.h.4"]``; the two may mix); or a ``Plan``, or a plan
            JSON path (``pipetrain plan -o``), which may replicate stages; or ``"auto"``: profile the
            model on the first minibatch and plan for ``workers`` at ``bandwidth`` (PipeDream §3.2).
        workers: data parallel: the workers, each holding the whole model and taking batch_size /
            workers samples of every minibatch (under torchrun: default WORLD_SIZE). Pipeline: the
            worker count for ``"auto"``; with a plan, it must match the plan's.
        bandwidth: link speed the automatic plan (``stages="auto"``) assumes, bytes/s or a string such as
            ``"1Gbit"`` (default 10 Gbit/s); only with ``stages="auto"``.
        schedule: pipeline: ``pipedream`` (default), ``naive``, ``gpipe``, ``1f1b-flush`` or ``model-parallel``.
        vertical_sync: pipeline, with ``pipedream``: every stage uses the input stage's weight version.
        microbatches: pipeline: slices per minibatch for ``gpipe`` and ``1f1b-flush``.
        staleness: pipe-sgd: K (default 2); minibatch m of an epoch takes its gradient at the weights
            after max(0, m-K+1) updates, and update j applies minibatch j-1's mean gradient; 1 is
            synchronous SGD.
        compression: pipe-sgd: ``None``, ``"trunc16"`` (upper 16 bits of each float32) or ``"quant8"``
            (8 bits with a scale per group), applied inside the ring allreduce; float32 models only.
        warmup_epochs: pipe-sgd: the first epochs run with K = 1.
        chunk: cgdp: layers per chunk (their gradients go to host memory together), or ``"auto"``
            (default): the paper's run-time search (:class:`pipetrain.strategies.ChunkSearch`).
        batch_size: samples per minibatch (one optimizer update of the whole job).
        epochs, shuffle, seed: passes over the data; with ``shuffle=False`` minibatch t (0-based)
            is items [t*B, (t+1)*B).
        checkpoint_dir: where each worker saves itself after every epoch; ``resume=True`` restarts
            from the newest epoch all workers completed; each worker keeps its ``keep_checkpoints``
            newest epochs (at least 2; None keeps all, e.g. to evaluate every epoch later with
            ``pipetrain.load_checkpoint``).
        max_restarts: when a worker dies or goes silent, stop the others, start every worker again
            from the newest epoch all of them saved, and go on, up to this many times (needs
            ``checkpoint_dir``). Under ``torchrun --max-restarts N`` the restarted ranks resume from
            ``checkpoint_dir`` by themselves. A worker's own error (a bad loss, a NaN) is not retried.
        timeout: seconds a worker waits on a silent peer before failing; a locally launched worker
            that shows no sign of life (stopped, hung) for min(timeout / 2, 20) seconds is named and the
            job stopped sooner: a merely slow worker still shows signs of life.
        threads: torch threads per worker (default: cores / workers).
        trace: record each action's start and end on every worker (``result.traces``); a directory
            also gets ``trace.json`` (Chrome trace, opens in Perfetto) and ``timeline.png``.
        progress: show a progress bar.
        allow_compression: ``strategy="auto"`` may pick a codec that changes the arithmetic (pipe-sgd's
            trunc16, quant8).
        lr_scheduler: a factory taking the optimizer, e.g. ``functools.partial(torch.optim.lr_scheduler.
            CosineAnnealingLR, T_max=100)``; every stage and replica steps its own after every update
            (so all follow the same schedule), and checkpoints keep its state.
        clip_grad_norm: before every update, scale gradients down to this norm at most. Data parallelism:
            the norm of the whole model's synced gradient, as on one machine. Pipeline: each stage clips
            its own gradient by its own norm (the global norm would need every stage's gradient of the
            same minibatch at once, which an asynchronous pipeline never has), so the bound holds per
            stage and the whole gradient may reach sqrt(stages) times it.
        eval_dataset: (input, target) pairs evaluated at the end of every epoch, forward only through the
            workers that train (no extra copy of the model), in eval mode, whole minibatches in order;
            the mean loss and ``metrics`` go into the epoch's last history record (``"eval"``), the
            progress bar and the metrics log.
        metrics: ``{name: function(output, target)}`` giving a minibatch's mean (e.g.
            :func:`pipetrain.accuracy`); needs ``eval_dataset``.
        precision: ``"fp32"`` (the model's own dtype) or ``"bf16"``: forwards and the loss run under
            autocast to bfloat16 (CPU and GPU); weights, gradients and updates stay in the model's dtype.
        log_dir: write ``metrics.jsonl`` there: one JSON line per update (``"kind": "update"``) and per
            evaluation (``"kind": "eval"``); ``pipetrain plot DIR`` draws it.

    Raises:
        ValueError: bad arguments (one line says which and what to do).
        PipetrainError: a worker failed (and no restart was left); the message names it, and the
            error carries the ``history`` recorded so far and the newest ``checkpoint_epoch``.
    """
    started = time.perf_counter()
    if strategy == "auto":
        arguments = dict(locals())
        del arguments["started"]
        return _train_auto(arguments)
    if allow_compression:
        raise ValueError("allow_compression is for strategy='auto'; name the codec with compression= instead")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: give how many times to restart, 0 or more")
    if max_restarts and checkpoint_dir is None:
        raise ValueError("max_restarts needs checkpoint_dir: a restarted job resumes from the workers' checkpoints")
    if bandwidth is not None and not (isinstance(stages, str) and stages == "auto"):
        raise ValueError(f"bandwidth={bandwidth!r} is only used to plan with stages='auto'; drop it (a plan file "
                         "was made for its own bandwidth)")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if under_torchrun() else 0
    if restarted and checkpoint_dir is not None:
        resume = True  # torchrun restarted this rank: resume from the checkpoints, as every rank does
    elif restarted:
        warn(f"torchrun restarted this job ({restarted} times) but it has no checkpoint_dir to resume from; "
             "training again from epoch 0")
    if lookup(STRATEGIES, strategy, "strategy").data_parallel:
        if workers is None and under_torchrun():
            workers = int(os.environ["WORLD_SIZE"])
        replicas = None if workers is None else [workers]
        boundaries = None if stages is None else _boundaries(stages)
        chosen = predicted = None
    else:
        if stages is None:
            raise ValueError("strategy='pipeline' needs stages: first layer indices, a plan, or 'auto' "
                             "(CLI: --stages 0,4 | --plan FILE | --plan auto --workers N)")
        boundaries = replicas = chosen = predicted = None
    settings: dict[str, Any]  # JobConfig's keyword arguments
    settings = dict(model=model, dataset=dataset, loss_fn=loss_fn, optimizer=optimizer, strategy=strategy,
                    boundaries=boundaries, replicas=replicas, schedule=schedule, vertical_sync=vertical_sync,
                    microbatches=microbatches, staleness=staleness, compression=compression,
                    warmup_epochs=warmup_epochs, chunk=chunk, batch_size=batch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                    checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir), resume=resume,
                    keep_checkpoints=keep_checkpoints, timeout=timeout, trace=bool(trace), progress=progress,
                    attempt=restarted, lr_scheduler=lr_scheduler, clip_grad_norm=clip_grad_norm,
                    eval_dataset=eval_dataset, metrics=metrics, precision=precision,
                    log_dir=None if log_dir is None else str(log_dir))
    cfg = JobConfig(**settings)  # every check that needs no plan, before any profiling
    if not cfg.data_parallel:
        layers = LayeredModel(model, cfg.example)
        chosen, predicted = _resolve_plan(stages, workers, len(layers), model, dataset, loss_fn, optimizer,
                                          batch_size, bandwidth, schedule, microbatches, _threads(threads, workers or 1),
                                          timeout)
        cfg = JobConfig(**{**settings, "boundaries": chosen.boundaries if chosen else _boundaries(stages, layers),
                           "replicas": chosen.replicas if chosen else None})
    cfg.threads = _threads(threads, cfg.world)
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != cfg.world:
        job = f"strategy {strategy!r} with workers={cfg.world}" if cfg.data_parallel else f"stages={cfg.boundaries}"
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} workers but {job} needs {cfg.world}; "
                         f"launch with --nproc-per-node/--nnodes giving {cfg.world} in all")
    name = describe(cfg.replicas, cfg.data_parallel)  # type: ignore[arg-type]
    if cfg.log_dir and cfg.resume_from is None and not restarted and int(os.environ.get("RANK", "0")) == 0:
        metrics_log(cfg.log_dir).unlink(missing_ok=True)  # a new run's log; a resumed one goes on
    restarts: list[dict[str, Any]] = []
    first_epoch = 0 if cfg.resume_from is None else cfg.resume_from + 1
    while True:
        if cfg.resume_from is not None and cfg.resume_from + 1 >= cfg.epochs:
            return _already_done(model, cfg, started, restarts, cfg.epochs - first_epoch)
        try:
            parts = run_rank(cfg)["parts"] if under_torchrun() else spawn(
                run_rank, cfg.world, (cfg,), describe=name, silent_after=min(timeout / 2, SILENT_AFTER_S),
                log_dir=cfg.checkpoint_dir)
            break
        except PipetrainError as e:
            kept = _kept_epoch(cfg)
            if e.kind == "error" or len(restarts) >= max_restarts or under_torchrun():
                e.checkpoint_epoch = kept
                e.history = _whole_history(cfg, kept, e.history)
                raise
            redone = sum(1 for h in e.history if kept is None or h["epoch"] > kept)
            restarts.append({"attempt": cfg.attempt, "error": str(e), "resumed_after_epoch": kept,
                             "redone_steps": redone, "time": time.perf_counter()})
            warn(f"{e}; restarting every worker after epoch {kept} ({len(restarts)} of {max_restarts} restarts)"
                 if kept is not None else f"{e}; restarting every worker from the start ({len(restarts)} of "
                 f"{max_restarts} restarts)")
            cfg = dataclasses.replace(cfg, resume=kept is not None, attempt=cfg.attempt + 1)
    result = _gather(model, parts, name, since_epoch=first_epoch)
    result.started, result.restarts, result.epochs_trained = started, restarts, cfg.epochs - first_epoch
    if chosen is not None:
        result.plan, result.predicted_samples_per_s = chosen, predicted
    if trace and not isinstance(trace, bool) and int(os.environ.get("RANK", "0")) == 0:
        what = f"{cfg.schedule}, stages {cfg.boundaries}" if not cfg.data_parallel else \
            f"{strategy}, {cfg.world} workers"
        _write_trace(result.traces, Path(trace), name, what)
    return result


_AUTO_PICKS = {"stages": None, "schedule": None, "vertical_sync": False, "microbatches": 1, "staleness": None,
               "compression": None, "warmup_epochs": 0, "chunk": None}
"""What ``strategy="auto"`` chooses, each at its unset value."""


def _train_auto(arguments: dict[str, Any]) -> TrainResult:
    """``train(strategy="auto", ...)``: choose on rank 0, print the table and the reason, train the choice."""
    given = [k for k, unset in _AUTO_PICKS.items() if arguments[k] != unset]
    if given:
        raise ValueError(f"strategy='auto' chooses {', '.join(given)} itself; drop {given[0]}, or name a strategy")
    workers = arguments["workers"] or (int(os.environ["WORLD_SIZE"]) if under_torchrun() else None)
    if workers is None or isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"strategy='auto' needs workers=N (CLI: --workers N), the workers to choose for; got {workers!r}")
    model, dataset, loss_fn, batch_size = (arguments[k] for k in ("model", "dataset", "loss_fn", "batch_size"))
    # the checks that need no strategy, before any measuring
    JobConfig(model=model, dataset=dataset, loss_fn=loss_fn, optimizer=arguments["optimizer"], strategy="ddp",
              replicas=[1], batch_size=batch_size, epochs=arguments["epochs"], timeout=arguments["timeout"])
    bandwidth = arguments["bandwidth"]
    one_machine = not under_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")

    def choose() -> dict[str, Any]:
        shard = batch_size // workers if batch_size % workers == 0 else batch_size
        measured = _measured_profile(model, dataset, loss_fn, arguments["optimizer"], batch_size, workers,
                                     _threads(arguments["threads"], workers), step_rows=shard)
        if measured.setup is not None:  # what the predictions below are priced with
            print(f"pipetrain: measured set-up: {measured.setup.describe()}", flush=True)
        return choose_strategy(measured, workers, bandwidth, batch_size=batch_size, one_machine=one_machine,
                               allow_compression=arguments["allow_compression"]).to_dict()

    found = _on_rank0(choose, arguments["timeout"])
    choice = Choice.from_dict(found)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"pipetrain: strategy auto\n{choice.table()}\n{choice.reason}", flush=True)
    picked = choice.options[choice.choice]
    if "stages" not in picked:
        picked["workers"] = workers
    result = train(**{**arguments, "bandwidth": None, "allow_compression": False, **picked})
    result.choice = found
    result.predicted_samples_per_s = choice.predictions[choice.choice]
    return result


DEFAULT_BANDWIDTH = "10Gbit"
"""The link speed ``stages="auto"`` plans for when no bandwidth is given."""

SILENT_AFTER_S = 20.0
"""A locally launched worker that shows no sign of life for this long (or half the ``timeout``, if
shorter) is declared silent (stopped, hung), before a peer's ``timeout`` would blame its neighbour."""


def _kept_epoch(cfg: JobConfig) -> int | None:
    """The newest epoch every worker saved whole for this job, or None (no checkpoints)."""
    if cfg.checkpoint_dir is None:
        return None
    return checkpoint.resume_epoch(cfg.checkpoint_dir, cfg.world, cfg.identity(), warn)


def _whole_history(cfg: JobConfig, kept: int | None, streamed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a failed run: those saved with the newest checkpoint, then those the workers
    streamed since (one per step)."""
    records = {h["step"]: h for h in (checkpoint.history(cfg.checkpoint_dir, cfg.world, kept)  # type: ignore[arg-type]
                                       if kept is not None else [])}
    records.update({h["step"]: h for h in streamed})
    return [records[k] for k in sorted(records)]


def _already_done(model: nn.Module, cfg: JobConfig, started: float, restarts: list[dict[str, Any]],
                  trained: int) -> TrainResult:
    """A resumed job whose every epoch is saved: the checkpointed model and history. ``trained``: the
    epochs this call trained before (a worker that failed after saving the last epoch is restarted
    into this)."""
    assert cfg.checkpoint_dir is not None and cfg.resume_from is not None
    if not restarts:
        warn(f"every requested epoch (up to {cfg.epochs - 1}) is already saved in {cfg.checkpoint_dir}; nothing "
             f"left to train, returning the model of epoch {cfg.resume_from} (ask for more epochs to train on)")
    return TrainResult(checkpoint.assemble(model, cfg.checkpoint_dir, cfg.resume_from),
                       checkpoint.history(cfg.checkpoint_dir, cfg.world, cfg.resume_from), 0.0, started=started,
                       restarts=restarts, epochs_trained=trained)


def _boundaries(stages: Any, layers: LayeredModel | None = None) -> list[int]:
    """A pipeline's first-layer indices from ``stages`` (indices, or the submodules later stages begin
    at, resolved on ``layers``); data parallelism (no ``layers``) gets the list back for its checks."""
    if isinstance(stages, (str, os.PathLike, Plan)):
        raise ValueError(f"stages={stages!r} is a plan; a data-parallel strategy takes no stages")
    if isinstance(stages, (int, float)) or not all(isinstance(b, (int, str)) and not isinstance(b, bool)
                                                   for b in stages):
        raise ValueError(f"stages={stages!r}: give the first layer index of each stage as integers, e.g. [0, 3, 7], "
                         "or the submodule each later stage begins at, e.g. ['transformer.h.2', 'transformer.h.4']")
    if layers is None or all(isinstance(b, int) for b in stages):
        return list(stages)
    return layers.boundaries(list(stages))


def _write_trace(traces: list[list[tuple[str, float, float]]], directory: Path, name: Callable[[int], str],
                 title: str) -> None:
    from pipetrain.trace import draw_timeline, write_chrome_trace

    directory.mkdir(parents=True, exist_ok=True)
    names = [name(r) for r in range(len(traces))]
    # local workers share the monotonic clock; under torchrun each host has its own origin
    start = min((t[0][1] for t in traces if t), default=0.0)
    offsets = None if under_torchrun() else [start] * len(traces)
    write_chrome_trace(traces, directory / "trace.json", names=names, offsets=offsets)
    draw_timeline(traces, directory / "timeline.png", title=f"{title}: measured", names=names, offsets=offsets)


def _threads(threads: int | None, workers: int) -> int:
    """Torch threads per worker: the cores of this machine shared by its workers, unless given."""
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads={threads!r}: give the torch threads per worker, at least 1 (or None: "
                             "the cores shared by the workers)")
        return threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    return max(1, (os.cpu_count() or 1) // local)


def _resolve_plan(stages: Any, workers: int | None, num_layers: int, model: nn.Module, dataset: Dataset,
                  loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: Callable[..., torch.optim.Optimizer],
                  batch_size: int, bandwidth: float | str | None, schedule: str | None, microbatches: int,
                  threads: int, timeout: float) -> tuple[Plan | None, float | None]:
    """The plan ``stages`` names (a Plan, a JSON path or "auto"), checked against the model, and its
    predicted samples/s; (None, None) for a plain list of boundaries."""
    if isinstance(stages, Plan):
        chosen, source = stages, "the plan"
    elif isinstance(stages, (str, os.PathLike)) and str(stages) == "auto":
        if workers is None:
            raise ValueError("stages='auto' needs workers=N (CLI: --workers N), the number of workers to plan for")
        found = _on_rank0(lambda: _plan_here(model, dataset, loss_fn, optimizer, batch_size, workers,
                                             bandwidth or DEFAULT_BANDWIDTH, schedule or DEFAULT_SCHEDULE,
                                             microbatches, threads), timeout)
        return Plan.from_dict(found["plan"]), found["predicted"]
    elif isinstance(stages, (str, os.PathLike)):
        chosen, source = Plan.load(stages), str(stages)
    else:
        if workers is not None:
            raise ValueError(f"workers={workers} is given beside explicit stages, which place one worker per stage; "
                             "drop workers, or plan with stages='auto'")
        return None, None
    check_fits(chosen, num_layers, source)
    if workers is not None and chosen.workers != workers:
        raise ValueError(f"{source} places {chosen.workers} workers but workers={workers} was asked for; "
                         f"use {chosen.workers} or make a new plan with `pipetrain plan --workers {workers}`")
    return chosen, batch_size / chosen.stage_time_s if chosen.stage_time_s > 0 else None


def _on_rank0(work: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
    """``work()`` here; under torchrun on rank 0 only, the others taking its result (plain data), so
    timing noise cannot split the job."""
    if not under_torchrun():
        return work()
    import torch.distributed as dist

    init_distributed(timeout)
    box: list[Any] = [work() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _measured_profile(model: nn.Module, dataset: Dataset, loss_fn: Callable[[Any, Any], torch.Tensor],
                      optimizer: Callable[..., torch.optim.Optimizer], batch_size: int, workers: int,
                      threads: int, step_rows: int | None = None, ring_cpu: bool = True) -> Profile:
    """The model profiled on the first minibatch with the workers' thread count and optimizer, building a
    minibatch from ``dataset`` timed (:func:`pipetrain.profiling.time_batching`); with the
    run set-up of ``workers`` local workers measured (:func:`pipetrain.runsetup.measure_setup`), their
    shared work a training step on the minibatch's first ``step_rows`` samples (default: all of them;
    a data-parallel worker's shard prices that worker directly), our ring's CPU timed unless
    ``ring_cpu`` is False (only pipe-sgd is priced with it), except under torchrun, whose workers
    this process does not start."""
    def first(rows: int) -> Any:
        return collate_parts(dataset, range(min(rows, len(dataset))), (0, 1))  # type: ignore[arg-type]

    batch = first(batch_size)
    try:
        with torch_threads(threads):
            measured = profile_model(model, tuple(batch), loss_fn, optimizer=optimizer, repeats=5, warmup=2)
            measured.inputs_s, measured.targets_s, measured.both_s = time_batching(dataset, batch_size)
    except LayerError:
        raise
    except Exception as e:  # the user's model, loss or optimizer on the user's data: say where it failed
        raise ValueError(f"the model failed on the dataset's first minibatch while pipetrain profiled it to plan: "
                         f"{one_line(e)}; check that the model, the loss and the dataset's samples "
                         "fit (dtype, shape)") from e
    if not under_torchrun():
        step = batch if step_rows is None else first(step_rows)
        measured.setup = measure_setup(workers, threads, model_step(model, tuple(step), loss_fn),
                                       ring_bytes=measured.parameter_bytes, ring_cpu=ring_cpu)
    return measured


def _plan_here(model: nn.Module, dataset: Dataset, loss_fn: Callable[[Any, Any], torch.Tensor],
               optimizer: Callable[..., torch.optim.Optimizer], batch_size: int, workers: int,
               bandwidth: float | str, schedule: str, microbatches: int, threads: int) -> dict[str, Any]:
    """Profile, plan for ``bandwidth`` and predict this run's samples/s.

    The partitioner plans (straight, for a schedule that cannot replicate a stage). Its model (PipeDream
    §3.2) lets a sync overlap compute, so its plan is simulated beside every layer as one stage on all
    the workers, and the faster is taken (the plan's ``options["simulated_samples_per_s"]`` holds both):
    the demo's partitioner picked 2-1-1 in 2 of 6 runs, which measured 3900-4300 samples/s, where one
    stage on 4 workers measured 5000-5300.

    Each is simulated for an epoch of its schedule, filled and drained, as ``samples_per_s`` measures it
    (:func:`training_rate`), on the links this run has (the measured transport locally, ``bandwidth``
    under torchrun), from a profile and set-up taken at the microbatch for a microbatched schedule
    (:func:`pipetrain.profiling.as_minibatch`). The demo's epochs are 44 minibatches of 280-360 ms, and
    23-30 ms passed between one's last update and the next one's first (no evaluation)."""
    measured = _measured_profile(model, dataset, loss_fn, optimizer, batch_size, workers, threads, ring_cpu=False)
    straight = not SCHEDULES[schedule].replicable
    candidates = [plan(measured, workers, bandwidth, straight=straight)]
    if not straight and len(candidates[0].stages) > 1:
        candidates.append(plan(measured, workers, bandwidth, one_stage=True))
    link = Link(parse_bandwidth(bandwidth)) if under_torchrun() else Link()
    at = measured if microbatches == 1 else as_minibatch(
        _measured_profile(model, dataset, loss_fn, optimizer, batch_size // microbatches, workers, threads,
                          ring_cpu=False), microbatches)
    rates = [predict_plan(at, c, link, batch_size, schedule,
                          max(per_epoch(len(dataset), batch_size, math.lcm(*c.replicas)), 1),  # type: ignore[arg-type]
                          microbatches=microbatches, epoch=True) for c in candidates]
    best = max(range(len(candidates)), key=rates.__getitem__)
    chosen = candidates[best]
    if len(candidates) > 1:
        chosen.options["simulated_samples_per_s"] = {c.config: r for c, r in zip(candidates, rates)}
    return {"plan": chosen.to_dict(), "predicted": rates[best] or None}


def training_rate(records: list[dict[str, Any]]) -> float:
    """Samples per second over the time the workers trained, from the records of the updates (as
    ``TrainResult.history`` holds them): each epoch from its start (its first update's time less that
    update's own interval) to its last update. The time between epochs, spent evaluating, saving
    checkpoints and gathering losses, is left out: with an evaluation after each of its 10 short epochs,
    the demo's plan 2-1-1 trained at 3575 samples/s, where its first-to-last-update span said 3227
    (plan 4: 4444 and 4340). 0 without records."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for h in records:
        e = h["epoch"]
        start[e] = min(start.get(e, math.inf), h["time"] - h["samples"] / h["samples_per_s"])
        end[e] = max(end.get(e, -math.inf), h["time"])
    seconds = sum(end[e] - start[e] for e in start)
    return sum(h["samples"] for h in records) / seconds if seconds > 0 else 0.0


def _gather(model: nn.Module, parts: list[dict[str, Any]], name: Callable[[int], str],
            since_epoch: int = 0) -> TrainResult:
    """The trained model and history from every rank's part (samples/s from the records of epochs
    ``since_epoch`` on: those trained by this run). Data-parallel workers must end bitwise identical:
    a difference is a bug, never a result."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part["state"])
    full = copy.deepcopy(model)
    missing = set(full.state_dict()) - set(state)
    if missing:
        raise PipetrainError(f"no stage returned {sorted(missing)[:3]}; those tensors are not used in "
                             "forward, so no stage owns them")
    full.load_state_dict(state)
    differ = [p["rank"] for p in parts if not p["state"] and p["digest"] != parts[0]["digest"]]
    if differ:
        raise PipetrainError(f"{name(differ[0])} ended with weights that differ from {name(0)}'s; data-parallel "
                             "workers must stay identical (please report this)")
    history = sorted((h for part in parts for h in part["history"]), key=lambda h: h["step"])
    speed = training_rate([h for h in history if h["epoch"] >= since_epoch])
    return TrainResult(full, history, speed, [part["trace"] for part in parts],
                       bytes_sent=[part["bytes_sent"] for part in parts],
                       sync_stats=[part["sync_stats"] for part in parts])
