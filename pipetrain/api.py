"""``pipetrain.train``: validate, start the workers (or join torchrun), gather the trained model."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain import auto
from pipetrain.batches import DEFAULT_TARGET_KEY, TargetKey
from pipetrain.config import JobConfig, RunOptions, Training, check_request
from pipetrain.errors import PipetrainError, warn
from pipetrain.layers import LayeredModel
from pipetrain.layout import Layout
from pipetrain.planning import Plan, check_fits
from pipetrain.planning.units import parse_bytes
from pipetrain.predict.memory import predict_memory
from pipetrain.registry import DEFAULT_SCHEDULE, Auto, PipelineSchedule, Strategy, as_schedule, as_strategy
from pipetrain.result import TrainResult, gather, write_trace
from pipetrain.runtime import checkpoint, logs, saving
from pipetrain.runtime.job import Start, run_rank
from pipetrain.runtime.dist import check_backend, local_workers
from pipetrain.runtime.launch import spawn, under_torchrun
from pipetrain.runtime.outcome import RankResult
from pipetrain.runtime.parts import Shipment, Source, local_parts

AUTO = "auto"
"""What ``stages``, ``strategy`` and ``schedule`` say to be planned, chosen or picked here."""

Stages = Sequence[int | str] | Plan | str | os.PathLike


def train(model: nn.Module, dataset: Dataset, *, loss_fn: Callable[[Any, Any], torch.Tensor],
          optimizer: Callable[..., torch.optim.Optimizer], strategy: str | Strategy | Auto = "pipeline",
          schedule: str | PipelineSchedule | None = None, stages: Stages | None = None, workers: int | None = None,
          bandwidth: float | str | None = None, memory_limit: float | str | None = None, batch_size: int = 32,
          epochs: int = 1, shuffle: bool = True, seed: int = 0, checkpoint_dir: str | os.PathLike | None = None,
          resume: bool = False, keep_checkpoints: int | None = 2, max_restarts: int = 0, timeout: float = 300.0,
          threads: int | None = None, trace: bool | str | os.PathLike = False, progress: bool = False,
          lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, clip_grad_norm: float | None = None,
          eval_dataset: Dataset | None = None, metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
          precision: str = "fp32", recompute: bool = False, compile: bool = False, log_dir: str | os.PathLike | None = None,
          backend: str = "auto", loader_workers: int = 0, prefetch: int = 2, target_key: TargetKey = DEFAULT_TARGET_KEY,
          collate_fn: Callable[[list[Any]], Any] | None = None, weights: str | os.PathLike | None = None,
          save: str | os.PathLike | None = None, max_steps: int | None = None) -> TrainResult:
    """Train ``model`` on ``dataset`` with several worker processes.

    Args:
        model: the model. A pipeline cuts it into layers: an ``nn.Sequential``, a ``torch.fx``-traceable
            module, or one ``torch.export`` captures; the data-parallel strategies take any module. Each
            worker is sent and holds only its own stage (data parallelism: the whole model). The model
            may be built on the meta device (``with torch.device("meta"): model = ...``), holding no
            memory: each worker then gives its stage's tensors their values from ``weights``, else
            initializes them as the model would, the same whatever the split
            (:func:`pipetrain.materialize` gives those weights in one process).
        dataset: a map-style dataset of ``(input, target)`` pairs (the model is called ``model(input)``),
            or of dictionaries (Hugging Face style ``{"input_ids", "attention_mask", "labels"}``): the
            ``target_key`` entry is the target and the others the keyword inputs (``model(**inputs)``);
            or a stream of either (an ``IterableDataset``), read in its own order, one pass an epoch
            (:mod:`pipetrain.streams`; docs/training.md).
        loss_fn: ``loss_fn(output, target)`` of a minibatch; mean-reduced for microbatching and sharding.
        optimizer: a factory taking parameters, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
        strategy: ``"pipeline"`` (stages on workers, run by ``schedule``), ``"ddp"``, ``"pipe-sgd"``,
            ``"cgdp"`` or ``"auto"``, each meaning its defaults; or an object with options:
            ``pipetrain.PipeSGD(staleness=2, compression="quant8")``, ``pipetrain.CGDP(chunk=2)``,
            ``pipetrain.Auto(allow_compression=True)`` (:mod:`pipetrain.registry`). ``"auto"`` profiles
            the model, measures this machine, predicts every strategy's samples/s for ``workers`` (at
            ``bandwidth``, else over the measured transport), prints the table and trains the fastest
            (``result.choice`` records it).
        schedule: a pipeline's schedule: ``"pipedream"`` (the default), ``"naive"``, ``"gpipe"``,
            ``"1f1b-flush"``, ``"zero-bubble"``, ``"interleaved-1f1b"``, ``"2bw"``, ``"model-parallel"``, or an
            object with options: ``pipetrain.GPipe(microbatches=4)``, ``pipetrain.PipeDream(vertical_sync=True)``,
            ``pipetrain.TwoBW(microbatches=4)``; or ``"auto"`` with ``stages="auto"``: every schedule is
            simulated at each microbatch count for the plan, the table printed, and the fastest run
            (``result.plan.options["schedules"]`` keeps it).
        stages: pipeline: the first layer index of each stage (one worker each), or the submodule each
            later stage begins at (``["transformer.h.2", "transformer.h.4"]``; the two may mix); or a
            ``Plan``, or a plan JSON path (``pipetrain plan -o``), which may replicate stages; or
            ``"auto"``: profile the model on the first minibatch and plan for ``workers`` at
            ``bandwidth`` (PipeDream §3.2).
        workers: data parallel: the workers, each holding the whole model and taking batch_size /
            workers samples of every minibatch (under torchrun: default WORLD_SIZE). Pipeline: the
            worker count for ``"auto"``; with a plan, it must match the plan's; with
            ``"interleaved-1f1b"``, the W workers that hold the stages round robin (stage s on s mod W).
        bandwidth: link speed ``stages="auto"`` plans for (default 10 Gbit/s) and ``strategy="auto"``
            predicts at, bytes/s or a string such as ``"1Gbit"``.
        memory_limit: with ``stages="auto"``, the bytes (or ``"16GiB"``) a worker may hold: the plan keeps
            each worker within it by the profile's per-layer bytes (its stage's weights, stashed weight
            versions and every layer's output for each (micro)batch in flight as the schedule and
            ``recompute`` keep them, gradients, optimizer state, a replicated stage's allreduce copies
            and, on the CPU, the worker process's baseline): more than autograd saves, so the plan's
            ``result.predicted_memory`` (:mod:`pipetrain.predict.memory`) is within it too.
        batch_size: samples per minibatch (one optimizer update of the whole job).
        epochs, shuffle, seed: passes over the data; with ``shuffle=False`` minibatch t (0-based)
            is items [t*B, (t+1)*B).
        checkpoint_dir: where each worker saves itself after every epoch, keyed by the model's names;
            ``resume=True`` restarts from the newest epoch all workers of the saving job completed,
            on its split or another (other stages, replicas, workers or strategy; the same model:
            docs/failures.md); each worker keeps its ``keep_checkpoints`` newest epochs (at least 2;
            None keeps all, e.g. to evaluate every epoch later with ``pipetrain.load_checkpoint``).
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
        recompute: activation recomputation: a worker keeps only a microbatch's inputs between its forward
            (run without gradients, its output sent on) and its backward, which first runs the forward
            again with the same weights and random state; results are exactly those without it, for an
            extra forward per microbatch (``result.stashed_bytes`` reports what is kept).
        compile: run every stage (data parallelism: the whole model) through ``torch.compile`` (inductor),
            for every schedule; the first minibatches pay the compilation, and ``strategy="auto"`` /
            ``stages="auto"`` profile the compiled layers. A stage that cannot be compiled fails the job
            with a one-line error naming it (see docs/training.md, "Compiled stages").
        log_dir: write ``metrics.jsonl`` there: one JSON line per update (``"kind": "update"``, its
            ``time`` in wall-clock seconds since this call began) and per evaluation (``"kind": "eval"``);
            ``pipetrain plot DIR`` draws it. With tensorboard installed (``pipetrain[tensorboard]``),
            TensorBoard files too (``tensorboard --logdir DIR``): ``train/loss``, ``train/lr``,
            ``train/samples_per_s`` per update, ``eval/loss`` and ``eval/METRIC`` per epoch, and each
            rank's memory peaks (``memory/...``) at the end.
        target_key: with dictionary items, the entry handed to ``loss_fn`` as the target (default
            ``"labels"``); a tuple of keys hands it the tuple of those entries, in order.
        collate_fn: builds a minibatch from a list of items, as ``DataLoader(collate_fn=...)`` does
            (e.g. transformers' ``DataCollatorWithPadding``); default ``default_collate``. A pipeline
            runs every minibatch in the first one's shapes: pad to one fixed length
            (``padding="max_length"``).
        backend: ``"auto"`` (NCCL when every worker of a machine has a GPU of its own, else gloo),
            ``"gloo"`` (several workers may share a GPU: what gloo cannot move on a GPU goes through
            host memory) or ``"nccl"`` (a GPU per worker).
        loader_workers: background processes per worker that build its next minibatches (its shard,
            its inputs or targets: what it uses) while it computes; 0 builds them inline. Results are
            bitwise the same either way: each item is fetched with its own seed (docs/training.md).
        prefetch: minibatches each loader keeps ready or in progress.
        weights: the model's weights, replacing what it holds: a ``.safetensors`` file, a directory
            ``save_pretrained`` wrote (one file or shards and their index), or a ``torch.save``'d state
            dict. Each worker reads only its stage's tensors; a tied parameter the file leaves out (as
            Hugging Face does ``lm_head.weight``) is read under its tie. Checked (names, shapes, dtypes)
            before any worker starts.
        save: where to write the trained model, stage by stage (never whole in one process): a directory
            gets what ``save_pretrained`` writes (a shard per stage, its index, the Hugging Face
            ``config.json``), a ``.safetensors`` path one file, a ``.pt`` path ``torch.save`` of the
            gathered state dict (:mod:`pipetrain.runtime.saving`). A model built on the meta device is
            not gathered (``result.model`` is None): give ``save`` to keep it.
        max_steps: stop after this many updates (minibatches) in all, however many epochs that is; a
            stream without ``len()`` then is read once, up to that many minibatches, instead of being
            counted by a first pass.

    Raises:
        ValueError: bad arguments (one line says which and what to do).
        PipetrainError: a worker failed (and no restart was left); the message names it, and the
            error carries the ``history`` recorded so far and the newest ``checkpoint_epoch``.
    """
    started = time.perf_counter()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if under_torchrun() else 0
    if restarted and checkpoint_dir is None:
        warn(f"torchrun restarted this job ({restarted} times) but it has no checkpoint_dir to resume from; "
             "training again from epoch 0")
    training = Training(model=model, dataset=dataset, loss_fn=loss_fn, optimizer=optimizer, batch_size=batch_size,
                        epochs=epochs, shuffle=shuffle, seed=seed, lr_scheduler=lr_scheduler,
                        clip_grad_norm=clip_grad_norm, precision=precision, recompute=recompute,
                        compile=compile, eval_dataset=eval_dataset, metrics=metrics, target_key=target_key, collate_fn=collate_fn,
                        weights=_path(weights), max_steps=max_steps)
    run = RunOptions(checkpoint_dir=_path(checkpoint_dir), resume=resume or bool(restarted and checkpoint_dir),
                     keep_checkpoints=keep_checkpoints, max_restarts=max_restarts, timeout=timeout,
                     threads=threads, trace=bool(trace), progress=progress, log_dir=_path(log_dir),
                     trace_dir=None if isinstance(trace, bool) else _path(trace), backend=backend,
                     loader_workers=loader_workers, prefetch=prefetch, save=_path(save))
    chosen = as_strategy(strategy)
    schedule_auto = isinstance(schedule, str) and schedule == AUTO
    if schedule_auto and not (isinstance(stages, str) and stages == AUTO):
        raise ValueError("schedule='auto' prices every schedule for a plan it makes: give stages='auto' and "
                         "workers=N as well (CLI: --schedule auto --plan auto --workers N)")
    picked = None if schedule is None or schedule_auto else as_schedule(schedule)
    if workers is None and under_torchrun() and (isinstance(chosen, Auto) or chosen.data_parallel):
        workers = int(os.environ["WORLD_SIZE"])
    check_request(chosen, schedule if schedule_auto else picked, stages, workers, bandwidth)
    _check_memory_limit(memory_limit, stages)
    choice, phases = None, {}  # type: dict[str, Any] | None, dict[str, float]
    if isinstance(chosen, Auto):
        assert workers is not None
        auto_pick = auto.choose(training, run, workers, bandwidth, chosen.allow_compression)
        chosen, picked, stages, choice = auto_pick.strategy, auto_pick.schedule, auto_pick.plan, auto_pick.choice
    layers: LayeredModel | None = None
    if chosen.data_parallel:
        assert workers is not None
        cfg = JobConfig(training, run, chosen, None, Layout.data_parallel_on(workers))
        plan, predicted = None, None
    else:
        if schedule_auto:
            assert workers is not None
            picked, plan, predicted, recompute = auto.plan_schedule(training, run, workers, bandwidth, phases,
                                                                    memory_limit)
            if recompute != training.recompute:  # a fresh Training checks the dataset again
                training = replace(training, recompute=recompute)
        picked = (picked or as_schedule(DEFAULT_SCHEDULE)).placed(workers)
        captured = time.perf_counter()
        layers = LayeredModel(model, JobConfig.example_of(training, picked.microbatches))
        phases["capture_s"] = time.perf_counter() - (captured if schedule_auto else started)
        if not schedule_auto:
            plan, predicted = _plan(training, run, picked, stages, workers, bandwidth, len(layers), phases,
                                    memory_limit)
        layout = Layout.pipeline(plan.boundaries, plan.replicas) if plan is not None else \
            Layout.pipeline(layers.boundaries(list(stages)))  # type: ignore[arg-type]
        cfg = JobConfig(training, run, chosen, picked, layout, layers)
    _preflight(cfg)
    memory = _predicted_memory(cfg, layers, phases)
    result = _launch(cfg, layers, started, restarted)
    result.plan, result.choice, result.phases = plan, choice, {**phases, **result.phases}
    result.predicted_samples_per_s = choice["predictions"][choice["choice"]] if choice else predicted
    result.predicted_memory = memory
    return result


def _predicted_memory(cfg: JobConfig, layers: LayeredModel | None, phases: dict[str, float]) -> list[int]:
    """Each worker's predicted peak memory (:func:`pipetrain.predict.memory.predict_memory`), its
    seconds in ``phases["memory_s"]``."""
    begun = time.perf_counter()
    device = auto.workers_device()
    memory = predict_memory(cfg, layers, auto.baseline_bytes(cfg.training, device, cfg.threads))
    phases["memory_s"] = time.perf_counter() - begun
    return memory


def _check_memory_limit(memory_limit: float | str | None, stages: Any) -> None:
    """``memory_limit`` is a size, and only given to plan with ``stages="auto"``; one line otherwise."""
    if memory_limit is None:
        return
    if not (isinstance(stages, str) and stages == "auto"):
        raise ValueError(f"memory_limit={memory_limit!r} is what stages='auto' plans within (CLI: --plan auto); drop "
                         "it, or plan with `pipetrain plan --memory`")
    parse_bytes(memory_limit, "memory_limit")


def _plan(training: Training, run: RunOptions, schedule: PipelineSchedule, stages: Stages | None, workers: int | None,
          bandwidth: float | str | None, num_layers: int, phases: dict[str, float],
          memory_limit: float | str | None = None) -> tuple[Plan | None, float | None]:
    """The plan ``stages`` names (a Plan, a plan JSON path, or ``"auto"``: made here, its phases' seconds
    added to ``phases``), checked against the model's ``num_layers`` and the ``workers`` asked for, and its
    predicted samples/s; (None, None) for stages given as first layers."""
    if isinstance(stages, str) and stages == "auto":
        assert workers is not None
        return auto.plan_stages(training, run, schedule, workers, bandwidth, phases, memory_limit)
    if not isinstance(stages, (str, os.PathLike, Plan)):
        return None, None
    plan = stages if isinstance(stages, Plan) else Plan.load(stages)
    source = "the plan" if isinstance(stages, Plan) else str(stages)
    check_fits(plan, num_layers, source)
    if workers is not None and plan.workers != workers:
        raise ValueError(f"{source} places {plan.workers} workers but workers={workers} was asked for; "
                         f"use {plan.workers} or make a new plan with `pipetrain plan --workers {workers}`")
    return plan, _priced(plan, training.batch_size, schedule)


def _priced(plan: Plan, batch_size: int, schedule: PipelineSchedule) -> float | None:
    """A saved plan's samples/s where it predicts this run: priced with a run set-up (not a bound), for
    ``pipedream`` without microbatches at this batch size, as :func:`pipetrain.predict.pipeline.price_plan`
    priced it; else None."""
    same = schedule.name == "pipedream" and schedule.microbatches == 1 and \
        plan.options.get("batch_size") == batch_size
    return plan.samples_per_s if plan.samples_per_s and not plan.bound and same else None


SILENT_AFTER_S = 20.0
"""A locally launched worker that shows no sign of life for this long (or half the ``timeout``, if
shorter) is declared silent (stopped, hung), before a peer's ``timeout`` would blame its neighbour."""


def _launch(cfg: JobConfig, layers: LayeredModel | None, started: float, restarted: int) -> TrainResult:
    """Run the job from where its checkpoints let it resume; when a worker dies or goes silent, start
    every worker again from the newest epoch all of them saved, up to ``max_restarts`` times. Each
    worker is sent only its own stages, cut from ``layers`` (None: data parallelism, the whole model);
    ``cfg`` has passed :func:`_preflight`."""
    t = cfg.training
    model, source, shipped = t.model, Source.of(t.model, t.weights, t.seed), cfg.without_model()
    if not cfg.gathers and cfg.run.save is None and cfg.run.checkpoint_dir is None:
        warn(f"{type(model).__name__} is built on the meta device, so the trained model is not gathered in this "
             "process; give save=PATH (CLI --save) to keep it")

    def stages(rank: int) -> list[tuple[int, int, int]]:
        return cfg.stages_of(rank, len(layers)) if layers is not None else []

    name = cfg.worker_name
    speaks = int(os.environ.get("RANK", "0")) == 0  # the one process that warns and writes for the run
    board = cfg.run.log_dir is not None and logs.board_check(warn_missing=speaks)
    start = Start(restarted, _kept_epoch(cfg) if cfg.run.resume else None, began=started, board=board)
    if cfg.run.resume and start.resume_from is None:
        warn(f"resume=True but {cfg.run.checkpoint_dir} holds no complete checkpoint of this job; starting from "
             "epoch 0")
    if cfg.run.log_dir and start.resume_from is None and not restarted and speaks:
        logs.start_fresh(cfg.run.log_dir)  # a new run's logs; a resumed one goes on
    restarts: list[dict[str, Any]] = []
    first_epoch = start.first_epoch
    with Shipment(layers, model, source) as shipment:
        while True:
            if start.first_epoch >= cfg.training.epochs_run(cfg.layout.rounds):
                done = _already_done(cfg, start, started, restarts,
                                     max(0, cfg.training.epochs_run(cfg.layout.rounds) - first_epoch))
                if cfg.run.save is not None and int(os.environ.get("RANK", "0")) == 0:
                    _save_done(cfg, done, start, source)
                return done
            try:
                launched = time.perf_counter()
                if under_torchrun():
                    rank = int(os.environ["RANK"])
                    parts = run_rank(shipped, start, local_parts(layers, model, stages(rank), source), source)["parts"]
                else:
                    parts = spawn(run_rank, cfg.world, lambda r: (shipped, start, shipment.parts(stages(r)), source),
                                  describe=name, log_dir=cfg.run.checkpoint_dir,
                                  silent_after=min(cfg.run.timeout / 2, SILENT_AFTER_S))
                break
            except PipetrainError as e:
                kept = _kept_epoch(cfg)
                if e.kind == "error" or len(restarts) >= cfg.run.max_restarts or under_torchrun():
                    e.checkpoint_epoch = kept
                    e.history = _whole_history(cfg, kept, e.history)
                    raise
                redone = sum(1 for h in e.history if kept is None or h["epoch"] > kept)
                restarts.append({"attempt": start.attempt, "error": str(e), "resumed_after_epoch": kept,
                                 "redone_steps": redone, "time": time.perf_counter()})
                warn(f"{e}; restarting every worker after epoch {kept} ({len(restarts)} of {cfg.run.max_restarts} "
                     "restarts)" if kept is not None else f"{e}; restarting every worker from the start "
                     f"({len(restarts)} of {cfg.run.max_restarts} restarts)")
                start = replace(start, attempt=start.attempt + 1, resume_from=kept)
    reports = [RankResult(**part) for part in parts]
    result = gather(model if cfg.gathers else None, reports, name, since_epoch=first_epoch)
    if board and speaks and cfg.run.log_dir is not None:
        logs.write_memory(cfg.run.log_dir, reports, max((h["step"] for h in result.history), default=0))
    if cfg.run.save is not None and int(os.environ.get("RANK", "0")) == 0:
        saving.finish(cfg.run.save, {k: v for r in reports for k, v in r.saved.items()}, model, result.model)
        result.saved = cfg.run.save
    written = time.perf_counter()
    result.started, result.restarts, result.epochs_trained = started, restarts, \
        cfg.training.epochs_run(cfg.layout.rounds) - first_epoch
    if not under_torchrun() and result.history:  # the workers share this process's clock
        ready = max(part.ready for part in reports)
        result.phases = {"start_s": ready - launched, "first_update_s": result.history[0]["time"] - ready}
        if cfg.run.save is not None:  # the stages write at once: the call waits from the last one's start
            result.phases["save_s"] = written - max(part.writing for part in reports)
    if cfg.run.trace_dir is not None and int(os.environ.get("RANK", "0")) == 0:
        what = f"{cfg.strategy.name}, {cfg.world} workers" if cfg.data_parallel else \
            f"{cfg.schedule.name if cfg.schedule else ''}, stages {list(cfg.layout.boundaries or ())}"
        write_trace(result.traces, Path(cfg.run.trace_dir), name, what, result.memory_traces)
    return result


def _preflight(cfg: JobConfig) -> None:
    """What the configuration cannot know: the launcher's world size, directories that must be
    writable (made if missing), room for what the strategy keeps in host memory."""
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != cfg.world:
        job = f"strategy {cfg.strategy.name!r} with workers={cfg.world}" if cfg.data_parallel else \
            f"stages={list(cfg.layout.boundaries or ())}"
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} workers but {job} needs {cfg.world}; "
                         f"launch with --nproc-per-node/--nnodes giving {cfg.world} in all")
    check_backend(cfg.run.backend, cfg.world)
    for option in ("checkpoint_dir", "log_dir", "save"):
        directory = getattr(cfg.run, option)
        if directory is not None:
            _check_writable(Path(directory) if option != "save" else saving.directory_of(directory), option)
    cfg.strategy.check_host(cfg.training.model, local_workers(cfg.world))


def _check_writable(directory: Path, name: str) -> None:
    """Files can be written in ``directory`` (made if missing), or a one-line ValueError naming option ``name``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".pipetrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{name} {str(directory)!r} is not usable ({e.strerror or type(e).__name__}); give a "
                         "directory this user can write to") from None


def _kept_epoch(cfg: JobConfig) -> int | None:
    """The newest epoch every worker of the job that saved it saved whole, for this job's model (on any
    layout or strategy), or None (no checkpoints)."""
    if cfg.run.checkpoint_dir is None:
        return None
    return checkpoint.resume_epoch(cfg.run.checkpoint_dir, cfg.identity(), warn)


def _whole_history(cfg: JobConfig, kept: int | None, streamed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a failed run: those saved with the newest checkpoint, then those the workers
    streamed since (one per step)."""
    saved = checkpoint.history(cfg.run.checkpoint_dir, kept) \
        if kept is not None and cfg.run.checkpoint_dir is not None else []
    records = {h["step"]: h for h in saved}
    records.update({h["step"]: h for h in streamed})
    return [records[k] for k in sorted(records)]


def _already_done(cfg: JobConfig, start: Start, started: float, restarts: list[dict[str, Any]],
                  trained: int) -> TrainResult:
    """A resumed job whose every epoch is saved: the checkpointed model and history. ``trained``: the
    epochs this call trained before (a worker that failed after saving the last epoch is restarted
    into this)."""
    assert cfg.run.checkpoint_dir is not None and start.resume_from is not None
    if not restarts:
        warn(f"every requested epoch (up to {cfg.training.epochs - 1}) is already saved in {cfg.run.checkpoint_dir}; "
             f"nothing left to train, returning the model of epoch {start.resume_from} (ask for more epochs to "
             "train on)")
    model = checkpoint.assemble(cfg.training.model, cfg.run.checkpoint_dir, start.resume_from) if cfg.gathers else None
    return TrainResult(model,
                       checkpoint.history(cfg.run.checkpoint_dir, start.resume_from), 0.0, started=started,
                       restarts=restarts, epochs_trained=trained)


def _save_done(cfg: JobConfig, done: TrainResult, start: Start, source: Source) -> None:
    """``save`` for a resumed job with nothing left to train: from the checkpoint's files, one at a time
    (a ``torch.save`` file from the model gathered from them)."""
    assert cfg.run.save is not None
    if saving.gathered_only(cfg.run.save):
        saving.finish(cfg.run.save, {}, cfg.training.model, done.model)
    else:
        assert cfg.run.checkpoint_dir is not None and start.resume_from is not None
        saving.write_checkpoint(cfg.run.save, cfg.run.checkpoint_dir, start.resume_from, cfg.training.model,
                                source.aliases)
    done.saved = cfg.run.save


def _path(value: str | os.PathLike | None) -> str | None:
    return None if value is None else str(value)
