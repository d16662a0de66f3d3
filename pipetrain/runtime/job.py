"""What one rank does from start to end: set up, train epoch by epoch, checkpoint, report."""
from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from pipetrain.errors import one_line, warn
from pipetrain.layers import LayeredModel, check_boundaries
from pipetrain.registry import (
    DEFAULT_SCHEDULE, SCHEDULES, STRATEGIES, StrategySpec, build_data_parallel, build_schedule, lookup,
)
from pipetrain.runtime import checkpoint
from pipetrain.runtime.dist import init_distributed
from pipetrain.runtime.launch import keep_freed_memory
from pipetrain.runtime.transport import Channel, Transport
from pipetrain.runtime.weights import POLICIES
from pipetrain.runtime.worker import (
    NonFiniteLoss, StepRecord, Worker, append_json, collate_parts, epoch_order, per_epoch, to_device,
)
from pipetrain.schedule import Schedule, evaluation, warmup
from pipetrain.strategies.base import GradSync, SyncContext
from pipetrain.strategies.cgdp import HOST_MEMORY, host_bytes
from pipetrain.strategies.compression import get_codec


@dataclass(kw_only=True)
class JobConfig:
    """Everything every rank needs, checked in one place (``__post_init__``) before any process starts.

    Options a strategy does not take are None (or their off value) and must stay so; the others get
    their defaults here. Each check raises a one-line ValueError saying what is wrong and what to do.

    Attributes:
        model, dataset, loss_fn, optimizer: as given to ``pipetrain.train``.
        strategy: a :data:`pipetrain.registry.STRATEGIES` name.
        boundaries: first layer of each stage (pipeline; None until a plan is resolved, and for
            data parallelism, where every worker runs the whole model).
        replicas: workers per stage; data parallelism: ``[workers]``.
        schedule, vertical_sync, microbatches: pipeline options.
        staleness, warmup_epochs, compression: data-parallel options (Pipe-SGD).
        chunk: CGDP's layers per chunk, or ``"auto"`` (the run-time search).
        batch_size: samples per optimizer update of the whole job (data parallelism splits it into
            one equal shard per worker).
        epochs, shuffle, seed, checkpoint_dir, resume, keep_checkpoints, timeout, threads, trace,
        progress, lr_scheduler, clip_grad_norm, eval_dataset, metrics, precision, log_dir: as given to
        ``pipetrain.train``.
        attempt: how many times the job was restarted before this run (0 at first).
        resume_from: the epoch the workers resume after (set by the checks when ``resume``), or None.
    """

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    strategy: str = "pipeline"
    boundaries: list[int] | None = None
    replicas: list[int] | None = None
    schedule: str | None = None
    vertical_sync: bool = False
    microbatches: int = 1
    staleness: int | None = None
    warmup_epochs: int = 0
    compression: str | None = None
    chunk: int | str | None = None
    batch_size: int = 32
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    keep_checkpoints: int | None = 2
    timeout: float = 300.0
    threads: int = 1
    trace: bool = False
    progress: bool = False
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    clip_grad_norm: float | None = None
    eval_dataset: Dataset | None = None
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None
    precision: str = "fp32"
    log_dir: str | None = None
    attempt: int = 0
    resume_from: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"model is a {type(self.model).__name__}, not a torch.nn.Module; pass the model itself")
        spec = self.spec
        self._check_options(spec)
        counts = (self.batch_size, self.microbatches, self.epochs)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts) or min(counts) < 1:
            raise ValueError(f"batch_size, microbatches and epochs must be >= 1 (got {self.batch_size}, "
                             f"{self.microbatches}, {self.epochs})")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 2:
            raise ValueError(f"keep_checkpoints={self.keep_checkpoints}: keep at least 2 (a worker may be one "
                             "epoch ahead of another, so resuming needs the previous epoch) or None for all")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (where the workers saved themselves)")
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: give the seconds a worker waits on a silent peer (> 0)")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads={self.threads}: give the torch threads per worker, at least 1")
        for name in ("loss_fn", "optimizer"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} is not callable; pass a function such as "
                                 + ("torch.nn.functional.mse_loss" if name == "loss_fn" else
                                    "functools.partial(torch.optim.SGD, lr=0.1)"))
        _check_pairs(self.dataset, "the dataset")
        self._check_training_loop()
        for name in ("checkpoint_dir", "log_dir"):
            if getattr(self, name) is not None:
                _check_writable(Path(getattr(self, name)), name)
        if spec.data_parallel:
            self._check_data_parallel(spec)
        else:
            self._check_pipeline()

    @property
    def example(self) -> Any:
        """The model input of the first minibatch (microbatch, with ``microbatches``) in dataset order:
        what ``torch.export`` captures a model that fx cannot trace on, for the shapes a stage sees
        (:class:`pipetrain.layers.LayeredModel`)."""
        n = min(self.batch_size // self.microbatches, len(self.dataset))  # type: ignore[arg-type]
        return collate_parts(self.dataset, range(n), (0,))[0]

    @property
    def spec(self) -> StrategySpec:
        return lookup(STRATEGIES, self.strategy, "strategy")

    def _check_options(self, spec: StrategySpec) -> None:
        """Options only other strategies take must be left at their defaults; fill in this one's."""
        given = {"stages": self.boundaries is not None, "schedule": self.schedule is not None,
                 "vertical_sync": self.vertical_sync, "microbatches": self.microbatches != 1,
                 "staleness": self.staleness is not None, "compression": self.compression is not None,
                 "warmup_epochs": self.warmup_epochs != 0, "chunk": self.chunk is not None}
        for option, is_given in given.items():
            if is_given and option not in spec.options:
                takes = [s.name for s in STRATEGIES.values() if option in s.options]
                raise ValueError(f"{option} applies to strategy {' or '.join(map(repr, takes))}, not "
                                 f"{self.strategy!r}; leave it out or change the strategy")
        if "schedule" in spec.options:
            self.schedule = self.schedule or DEFAULT_SCHEDULE
        if spec.stale:
            self.staleness = 2 if self.staleness is None else self.staleness
        if "chunk" in spec.options:
            self.chunk = "auto" if self.chunk is None else self.chunk

    def _check_data_parallel(self, spec: StrategySpec) -> None:
        if self.replicas is None or len(self.replicas) != 1:
            raise ValueError(f"strategy {self.strategy!r} needs workers=N (CLI: --workers N), the data-parallel "
                             "workers, each holding the whole model")
        workers = self.replicas[0]
        if workers < 1:
            raise ValueError(f"workers={workers} must be at least 1")
        if self.batch_size % workers:
            raise ValueError(f"batch_size {self.batch_size} does not split into {workers} equal shards; use a "
                             f"multiple of {workers} (each worker takes batch_size / workers samples)")
        if self.staleness is not None and self.staleness < 1:
            raise ValueError(f"staleness={self.staleness} must be at least 1 (1 is synchronous SGD; Pipe-SGD "
                             "uses 2)")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={self.warmup_epochs} must be >= 0")
        codec = get_codec(self.compression)
        dtypes = {p.dtype for p in self.model.parameters() if p.requires_grad}
        if codec.lossy and dtypes != {torch.float32}:
            raise ValueError(f"compression={self.compression!r} works on float32 gradients, but the model's "
                             f"parameters are {', '.join(sorted(str(d) for d in dtypes))}; use a float32 model "
                             "or compression=None")
        if self.chunk is not None:
            self._check_chunk(workers)
        self._check_items(1)
        self._check_checkpoints()

    def _check_chunk(self, workers: int) -> None:
        """CGDP: a chunk size, and room in the machine's shared memory for its gradients."""
        if not (self.chunk == "auto" or (isinstance(self.chunk, int) and not isinstance(self.chunk, bool)
                                         and self.chunk >= 1)):
            raise ValueError(f"chunk={self.chunk!r}: give the layers per chunk (an integer >= 1) or 'auto' "
                             "(the run-time search)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
        need = host_bytes(sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad),
                          local)
        if HOST_MEMORY.is_dir():
            st = os.statvfs(HOST_MEMORY)
            if need > st.f_bavail * st.f_frsize:
                raise ValueError(f"cgdp needs {need / 2**20:.0f} MiB of shared memory in {HOST_MEMORY} for {local} "
                                 f"workers' gradients, but {st.f_bavail * st.f_frsize / 2**20:.0f} MiB are free; "
                                 "enlarge it (docker: --shm-size) or use another strategy")

    def _check_pipeline(self) -> None:
        sched = lookup(SCHEDULES, self.schedule, "schedule")  # type: ignore[arg-type]
        if self.vertical_sync and sched.weights != "stash":
            raise ValueError(f"vertical_sync applies to the 'pipedream' schedule, not {self.schedule!r}")
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by microbatches {self.microbatches}; "
                             "pick a batch size that splits evenly")
        if self.microbatches > 1 and not sched.microbatched:
            takes = " / ".join(repr(s.name) for s in SCHEDULES.values() if s.microbatched)
            raise ValueError(f"schedule {self.schedule!r} does not split minibatches; use microbatches=1 or {takes}")
        if self.boundaries is None:
            return  # the plan is not resolved yet; checked again once it is
        if self.replicas is None:
            self.replicas = [1] * len(self.boundaries)
        if len(self.replicas) != len(self.boundaries) or any(r < 1 for r in self.replicas):
            raise ValueError(f"replicas {self.replicas} must give a positive worker count for each of the "
                             f"{len(self.boundaries)} stages")
        layers = LayeredModel(self.model, self.example)
        check_boundaries(self.boundaries, len(layers))
        shared = layers.shared_parameters(self.boundaries)
        if shared:
            name, stages = next(iter(shared.items()))
            raise ValueError(f"parameter {name} is used by stages {stages} (tied weights), and each stage would train "
                             "its own copy; untie it (Hugging Face: tie_word_embeddings=False) or cut elsewhere")
        if self.vertical_sync and self.world != len(self.replicas):
            raise ValueError(f"vertical_sync needs one worker per stage; this plan replicates stages {self.replicas}")
        self._check_items(math.lcm(*self.replicas))
        self._check_checkpoints()

    def _check_training_loop(self) -> None:
        """The scheduler, clipping, evaluation, precision and log options."""
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ValueError(f"lr_scheduler={self.lr_scheduler!r} is not callable; pass a factory taking the optimizer, "
                             "e.g. functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=100)")
        if self.clip_grad_norm is not None and (isinstance(self.clip_grad_norm, bool) or
                                                not isinstance(self.clip_grad_norm, (int, float)) or
                                                not self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r}: give the largest gradient norm, a number > 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(map(repr, PRECISIONS))}")
        if self.metrics is not None:
            if self.eval_dataset is None:
                raise ValueError("metrics are computed on eval_dataset; give eval_dataset too")
            if not isinstance(self.metrics, dict) or not all(isinstance(k, str) and callable(f)
                                                             for k, f in self.metrics.items()):
                raise ValueError("metrics must be a dict of name -> function(output, target), e.g. "
                                 "{'accuracy': pipetrain.accuracy}")
            if "loss" in self.metrics:
                raise ValueError("metrics: 'loss' is reported already (loss_fn on eval_dataset); name the metric otherwise")
        if self.eval_dataset is not None:
            n = _check_pairs(self.eval_dataset, "eval_dataset")
            if n < self.batch_size:
                raise ValueError(f"eval_dataset has {n} items, fewer than one minibatch of {self.batch_size}; give more "
                                 "items or a smaller batch_size")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must have been saved by to be resumed by this job."""
        layout = {"workers": self.world} if self.data_parallel else {"boundaries": self.boundaries,
                                                                     "replicas": self.replicas}
        return {"model": checkpoint.fingerprint(self.model), "strategy": self.strategy, "world": self.world,
                "layout": layout}

    def _check_checkpoints(self) -> None:
        """A resumed job resumes after the newest epoch every worker saved whole, for this job."""
        if not self.resume or self.checkpoint_dir is None:
            return
        self.resume_from = checkpoint.resume_epoch(self.checkpoint_dir, self.world, self.identity(), warn)
        if self.resume_from is None:
            warn(f"resume=True but {self.checkpoint_dir} holds no complete checkpoint of this job; starting from "
                 "epoch 0")

    def _check_items(self, rounds: int) -> None:
        n_items = len(self.dataset)  # type: ignore[arg-type]
        if n_items < self.batch_size * rounds:
            raise ValueError(f"the dataset has {n_items} items, fewer than one round of minibatches "
                             f"({self.batch_size * rounds}); use a smaller batch_size")

    # -- what the ranks read ------------------------------------------------------------------------
    @property
    def data_parallel(self) -> bool:
        return self.spec.data_parallel

    @property
    def world(self) -> int:
        assert self.replicas is not None
        return sum(self.replicas)

    @property
    def rounds(self) -> int:
        """Minibatches an epoch's count must be a multiple of (every replica of a stage joins every sync)."""
        assert self.replicas is not None
        return 1 if self.data_parallel else math.lcm(*self.replicas)

    def stage_of(self, rank: int) -> int:
        assert self.replicas is not None
        return next(s for s in range(len(self.replicas)) if rank < sum(self.replicas[:s + 1]))

    def reporter(self, rank: int) -> bool:
        """Does ``rank`` record the training history (the output stage; rank 0 of data parallelism)?"""
        assert self.replicas is not None
        return rank == 0 if self.data_parallel else rank >= self.world - self.replicas[-1]

    def staleness_at(self, epoch: int) -> int:
        """K for ``epoch``: 1 (synchronous) during the warm-up epochs and for synchronous strategies."""
        return 1 if self.staleness is None or epoch < self.warmup_epochs else self.staleness

    def schedule_for(self, epoch: int, minibatches: int) -> Schedule:
        if self.data_parallel:
            return build_data_parallel(self.strategy, self.world, minibatches, self.staleness_at(epoch))
        assert self.schedule is not None and self.replicas is not None
        return build_schedule(self.schedule, self.replicas, minibatches, self.microbatches)

    def layer_range(self, stage: int, num_layers: int) -> tuple[int, int]:
        assert self.boundaries is not None
        ends = [*self.boundaries[1:], num_layers]
        return self.boundaries[stage], ends[stage] - 1

    def policy_name(self, stage: int) -> str:
        """The weight policy of ``stage``'s workers (:data:`pipetrain.runtime.weights.POLICIES`)."""
        if self.data_parallel:
            return "live"
        assert self.schedule is not None and self.replicas is not None
        name = "vertical" if self.vertical_sync else SCHEDULES[self.schedule].weights
        if name == "stash" and warmup(self.replicas, stage) == 1:
            return "live"  # one minibatch in flight: no update between its forward and backward
        return name


def describe(replicas: list[int], data_parallel: bool = False) -> Callable[[int], str]:
    """rank -> ``"stage s (rank r)"`` (``"stage s replica i (rank r)"`` for replicated stages,
    ``"worker r"`` for data parallelism)."""
    owner = [(s, i) for s, r in enumerate(replicas) for i in range(r)]

    def name(rank: int) -> str:
        s, i = owner[rank]
        if data_parallel:
            return f"worker {rank}"
        return f"stage {s} (rank {rank})" if replicas[s] == 1 else f"stage {s} replica {i} (rank {rank})"
    return name


def edges(replicas: list[int]) -> list[tuple[int, int]]:
    """Every directed worker pair that exchanges activations or gradients."""
    probe = Schedule("edges", tuple(replicas), tuple(() for _ in range(sum(replicas))))
    out = set()
    for s in range(len(replicas) - 1):
        for mb in range(math.lcm(replicas[s], replicas[s + 1])):
            a, b = probe.worker_for(s, mb), probe.worker_for(s + 1, mb)
            out |= {(a, b), (b, a)}
    return sorted(out)


def run_rank(cfg: JobConfig) -> dict[str, Any]:
    """Train this rank's part; return its state, history (reporting ranks) and trace, as plain data."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prepare_process(cfg)
    device = init_distributed(cfg.timeout)
    result = _train(cfg, rank, world, device)
    # only after success: teardown with a dead peer can block, and on failure the launcher
    # (ours or torchrun) stops every process anyway
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":
        dist.destroy_process_group()
    return result


def prepare_process(cfg: JobConfig) -> None:
    """Set this process up as a worker's: malloc keeps freed memory, ``cfg.threads`` torch threads,
    torch's random generator seeded with ``cfg.seed``."""
    keep_freed_memory()  # also under torchrun, which starts the process
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)


def build_worker(cfg: JobConfig, rank: int, device: torch.device, transport: Channel,
                 sync: GradSync | None) -> tuple[Worker, nn.Module]:
    """``rank``'s worker as the job runs it, around ``transport`` and ``sync``: its stage (the whole
    model for data parallelism), optimizer and weight policy, restored from the checkpoint the job
    resumes from (``cfg.resume_from``), if any.

    Returns:
        The worker, with the history it resumes, and its stage module unwrapped (what checkpoints save).
    """
    assert cfg.replicas is not None
    stage_idx = cfg.stage_of(rank)
    if cfg.data_parallel:
        stage = cfg.model.to(device)  # every worker holds the whole model
    else:
        # captured on the worker's device: an exported graph fixes the device of tensors it makes (arange)
        layers = LayeredModel(cfg.model.to(device), to_device(cfg.example, device))
        stage = layers.stage(*cfg.layer_range(stage_idx, len(layers))).to(device)
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = cfg.optimizer(params) if params else None
    scheduler = cfg.lr_scheduler(optimizer) if optimizer is not None and cfg.lr_scheduler is not None else None
    version, history = 0, []
    if cfg.resume_from is not None:
        state = checkpoint.load(cfg.checkpoint_dir, rank, cfg.resume_from)  # type: ignore[arg-type]
        stage.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        version, history = state["version"], state.get("history", [])
        _set_rng(state["rng"], device)  # dropout and the like go on as if never stopped
    policy = POLICIES[cfg.policy_name(stage_idx)](stage)
    policy.version = version
    first = sum(cfg.replicas[:stage_idx])
    worker = Worker(rank, sync.wrap(stage) if sync else stage, policy, optimizer, transport, cfg.dataset,
                    cfg.loss_fn, cfg.batch_size, device, grad_sync=sync, trace=[] if cfg.trace else None,
                    shard=(rank - first, cfg.replicas[stage_idx]) if cfg.data_parallel else (0, 1),
                    name=describe(cfg.replicas, cfg.data_parallel)(rank), attempt=cfg.attempt,
                    log=_history_log(rank) if cfg.reporter(rank) else None, scheduler=scheduler,
                    clip_grad_norm=cfg.clip_grad_norm, precision=cfg.precision,
                    metrics_log=metrics_log(cfg.log_dir) if cfg.log_dir and cfg.reporter(rank) else None)
    worker.history = [StepRecord(**h) for h in history]
    return worker, stage


def _train(cfg: JobConfig, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    assert cfg.replicas is not None
    transport = Transport(rank, edges(cfg.replicas), describe(cfg.replicas, cfg.data_parallel), device, cfg.timeout)
    sync = cfg.spec.synchronizer(SyncContext(rank, tuple(cfg.replicas), device, cfg.timeout, cfg.compression,
                                             cfg.stage_of(rank), cfg.chunk))
    worker, stage = build_worker(cfg, rank, device, transport, sync)
    optimizer, policy = worker.optimizer, worker.policy
    start = 0 if cfg.resume_from is None else cfg.resume_from + 1

    n_items = len(cfg.dataset)  # type: ignore[arg-type]
    k = per_epoch(n_items, cfg.batch_size, cfg.rounds)
    bar = _progress(cfg, rank, (cfg.epochs - start) * k)
    # the bar's rank records its own minibatches: every one (data parallel), or 1 in r (one of the r
    # replicas of the output stage; the bar ended at 25% on 4 replicas)
    per_record = 1 if cfg.data_parallel else cfg.replicas[-1]
    # the postfix waits for the bar's next redraw (tqdm's mininterval): redrawing it after every minibatch
    # took 0.08 ms of a 1.1 ms minibatch of the example MLP
    on_step = (lambda rec: bar.set_postfix(loss=f"{rec.loss:.4f}", refresh=False) or bar.update(per_record)) \
        if bar else None
    for epoch in range(start, cfg.epochs):
        batches = epoch_order(n_items, cfg.batch_size, epoch, cfg.shuffle, cfg.seed, cfg.rounds)
        try:
            worker.run_epoch(cfg.schedule_for(epoch, len(batches)), epoch, batches, epoch * k, on_step)
        except NonFiniteLoss as e:
            kept = epoch - 1 if cfg.checkpoint_dir and epoch > 0 else None
            where = f"the checkpoint of epoch {kept} in {cfg.checkpoint_dir} is kept" if kept is not None \
                else "no checkpoint was saved"
            raise NonFiniteLoss(f"{e}; training stopped, {where}; lower the learning rate") from None
        if cfg.data_parallel:
            _mean_losses(worker.history[-len(batches):], cfg.world, device)
            agree_buffers(stage, cfg.world)
        if cfg.eval_dataset is not None:
            scores = _evaluate(cfg, worker, epoch, device, (epoch + 1) * k)
            if bar:
                bar.write(f"epoch {epoch}: held-out " + ", ".join(f"{name} {v:.4g}" for name, v in scores.items()))
        if cfg.checkpoint_dir:
            checkpoint.save(cfg.checkpoint_dir, rank, epoch, {
                "model": stage.state_dict(), "optimizer": optimizer.state_dict() if optimizer else {},
                "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else {},
                "epoch": epoch, "version": policy.version, "rng": _rng(device),
                "history": [asdict(h) for h in worker.history] if cfg.reporter(rank) else []},
                cfg.identity(), keep=cfg.keep_checkpoints)
    if bar:
        bar.close()
    if sync:
        sync.close()
    transport.close()
    state = {k: v.detach().cpu() for k, v in stage.state_dict().items()}
    result = {"rank": rank, "digest": _digest(state) if cfg.data_parallel else None,
              # data parallelism: every worker holds the same model; rank 0's comes back, the others' digests
              "state": state if not cfg.data_parallel or rank == 0 else {},
              "history": [asdict(h) for h in worker.history] if cfg.reporter(rank) else [],
              "trace": worker.trace or [],
              "bytes_sent": transport.bytes_sent + (sync.bytes_sent if sync else 0),
              "sync_stats": sync.stats() if sync else {}}
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":  # torchrun: every rank gets every rank's part
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, result)
        return {"parts": parts}
    return result


def _evaluate(cfg: JobConfig, worker: Worker, epoch: int, device: torch.device, step: int) -> dict[str, float]:
    """Evaluate on ``cfg.eval_dataset`` at the end of ``epoch`` (every rank takes part): whole minibatches
    in dataset order, forward only through the stages (each replica its round-robin share; data
    parallelism: each worker its shard). Returns the means over the samples of the loss and each metric,
    recorded with the epoch's last update (``step``) and in the metrics log."""
    assert cfg.eval_dataset is not None and cfg.replicas is not None
    metrics = cfg.metrics or {}
    n_items = len(cfg.eval_dataset)  # type: ignore[arg-type]
    batches = epoch_order(n_items, cfg.batch_size, 0, False, 0, 1)
    schedule = evaluation(tuple(cfg.replicas), len(batches), cfg.data_parallel)
    sums = torch.tensor(worker.evaluate(schedule, batches, cfg.eval_dataset, metrics), dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums)  # the output stage's sums (every data-parallel worker's shards) reach every rank
    means = (sums[:-1] / sums[-1]).tolist()
    scores = dict(zip(["loss", *metrics], means))
    for record in worker.history[::-1]:  # the replica of the output stage that made the epoch's last update
        if record.step == step:
            record.eval = scores
            if worker.metrics_log is not None:
                append_json(worker.metrics_log, {"kind": "eval", "epoch": epoch, "step": step, **scores})
            break
    return scores


def metrics_log(log_dir: str | os.PathLike) -> Path:
    """The metrics log a job writes in ``log_dir``: JSON lines, ``{"kind": "update", ...}`` per update
    (a :class:`StepRecord`), ``{"kind": "eval", "epoch", "step", "loss", METRIC...}`` per evaluation."""
    return Path(log_dir) / "metrics.jsonl"


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
            parts = [torch.empty_like(buf) for _ in range(world)]
            dist.all_gather(parts, buf.detach().contiguous())
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
    if not cfg.progress or rank != (0 if cfg.data_parallel else cfg.world - 1):
        return None
    import threading

    from tqdm import tqdm
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


PRECISIONS = ("fp32", "bf16")
"""``precision``: fp32 computes in the model's own dtype; bf16 runs forwards and losses under autocast
to bfloat16 (what crosses a stage boundary is then bfloat16: half the bytes)."""


def _check_pairs(dataset: Dataset, what: str) -> int:
    """The item count of a map-style dataset of (input, target) pairs, or a one-line ValueError."""
    try:
        n_items, item = len(dataset), dataset[0]  # type: ignore[arg-type]
    except Exception as e:  # a dataset raises what it likes; all mean it cannot be used
        raise ValueError(f"{what} cannot be read ({one_line(e)}); give a map-style dataset "
                         "(len() and [i]) of (input, target) pairs") from None
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise ValueError(f"{what}'s items must be (input, target) pairs, but item 0 is {kind}; wrap it so each item "
                         "is (input, target)")
    if n_items < 1:
        raise ValueError(f"{what} is empty")
    return n_items


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


def _history_log(rank: int) -> Path | None:
    """Where a locally launched reporter streams its history, so a failed run keeps it."""
    workdir = os.environ.get("PIPETRAIN_WORKDIR")
    return Path(workdir) / f"history{rank}.jsonl" if workdir else None
