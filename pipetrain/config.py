"""One validated configuration of a job, built once before any worker starts.

A job is made of parts, each checked when it is made: :class:`Training` (what is trained and how each
update goes), :class:`RunOptions` (checkpoints, restarts, timeouts, what is recorded), the strategy and
schedule objects of :mod:`pipetrain.registry` (their own options) and the
:class:`~pipetrain.layout.Layout` (which worker runs what). :class:`JobConfig` puts them together and
checks the rules that span them. Every check raises a one-line ValueError saying what is wrong and what
to do. Nothing here creates directories or reads checkpoints: that is the launcher's
(:mod:`pipetrain.api`), once the configuration holds.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from pipetrain.batches import DEFAULT_TARGET_KEY, TargetKey, epoch_order, first_inputs, per_epoch
from pipetrain.errors import named, warn
from pipetrain.dataset_items import check_items
from pipetrain.streams import is_stream, known_length
from pipetrain.layers import LayeredModel, check_boundaries
from pipetrain.layout import Layout
from pipetrain.planning import Plan
from pipetrain.registry import Auto, PipelineSchedule, Strategy
from pipetrain.runtime import checkpoint
from pipetrain.initialize import check_initializable
from pipetrain.runtime.compiled import check_compilable
from pipetrain.runtime.parts import aliases, is_meta
from pipetrain.runtime.saving import check_save
from pipetrain.weightfiles import WeightFiles
from pipetrain.runtime.dist import BACKENDS, local_workers
from pipetrain.schedule import Schedule

PRECISIONS = ("fp32", "bf16")
"""``precision``: fp32 computes in the model's own dtype; bf16 runs forwards and losses under autocast
to bfloat16 (what crosses a stage boundary is then bfloat16: half the bytes)."""


@dataclass(frozen=True, kw_only=True)
class Training:
    """What is trained and how each update goes (the arguments of :func:`pipetrain.train` of that name)."""

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    batch_size: int = 32
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    recompute: bool = False
    compile: bool = False
    eval_dataset: Dataset | None = None
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None
    target_key: TargetKey = DEFAULT_TARGET_KEY
    collate_fn: Callable[[list[Any]], Any] | None = None
    weights: str | None = None
    max_steps: int | None = None
    n_items: int | None = field(init=False, default=None)
    """Items in the dataset (one pass of a stream); None for a stream of unknown length bounded by
    ``max_steps``."""
    n_eval_items: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"model is a {type(self.model).__name__}, not a torch.nn.Module; pass the model itself")
        self._check_weights()
        counts = (self.batch_size, self.epochs)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts) or min(counts) < 1:
            raise ValueError(f"batch_size and epochs must be integers >= 1 (got {self.batch_size}, {self.epochs})")
        for name, example in (("loss_fn", "torch.nn.functional.mse_loss"),
                              ("optimizer", "functools.partial(torch.optim.SGD, lr=0.1)")):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name}={named(getattr(self, name))} is not callable; pass a function such as {example}")
        keys = self.target_key if isinstance(self.target_key, str) else \
            tuple(self.target_key) if isinstance(self.target_key, (tuple, list)) else None
        if not (isinstance(keys, str) or keys and all(isinstance(k, str) for k in keys)):
            raise ValueError(f"target_key={self.target_key!r}: name the dictionary entry that is the target (a "
                             "string), or several (a tuple of strings)")
        object.__setattr__(self, "target_key", keys)
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise ValueError(f"collate_fn={named(self.collate_fn)} is not callable; pass a function from a list of items "
                             "to a minibatch, as DataLoader(collate_fn=...) takes")
        self._check_steps()
        n_items = check_items(self.dataset, "the dataset", keys, self.collate_fn,
                               counted=self.max_steps is None or known_length(self.dataset) is not None)
        if n_items is not None and n_items < self.batch_size:
            raise ValueError(f"the dataset has {n_items} items, fewer than one minibatch of {self.batch_size}; use a "
                             "smaller batch_size")
        object.__setattr__(self, "n_items", n_items)
        if is_stream(self.dataset) and n_items is not None and n_items % self.batch_size:
            warn(f"the stream's last {n_items % self.batch_size} items do not fill a minibatch of {self.batch_size}; "
                 "every epoch leaves them out")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ValueError(f"lr_scheduler={named(self.lr_scheduler)} is not callable; pass a factory taking the optimizer, "
                             "e.g. functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=100)")
        if self.clip_grad_norm is not None and (isinstance(self.clip_grad_norm, bool) or
                                                not isinstance(self.clip_grad_norm, (int, float)) or
                                                not self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r}: give the largest gradient norm, a number > 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(map(repr, PRECISIONS))}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute={self.recompute!r} must be True (keep only each stage's inputs and run the "
                             "forward again before the backward) or False")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r} must be True (each stage runs through torch.compile) or False")
        if self.compile:
            check_compilable()
        self._check_evaluation()

    def _check_steps(self) -> None:
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"max_steps={named(self.max_steps)}: give the most updates to make, an integer >= 1 "
                             "(or None: every minibatch of every epoch)")
        if is_stream(self.dataset) and self.max_steps is not None and known_length(self.dataset) is None \
                and self.epochs > 1:
            raise ValueError(f"epochs={self.epochs} with a stream of unknown length bounded by max_steps: the run "
                             "reads the stream once; give epochs=1, or leave max_steps out to have the stream counted")

    def _check_weights(self) -> None:
        """Every tensor the model saves is in ``weights`` with its shape and dtype (a tied one under any of
        its names), read from the files' headers; and a model on the meta device without ``weights`` can
        be initialized by :mod:`pipetrain.initialize`'s rule."""
        if self.weights is None:
            if is_meta(self.model):
                check_initializable(self.model)
            return
        if not isinstance(self.weights, (str, os.PathLike)):
            raise ValueError(f"weights={self.weights!r}: give the path of a .safetensors file, a directory "
                             "save_pretrained wrote, or a torch.save'd state dict")
        object.__setattr__(self, "weights", os.fspath(self.weights))
        saved = self.model.state_dict(keep_vars=True)
        WeightFiles.open(self.weights).check({k: (tuple(t.shape), t.dtype) for k, t in saved.items()},
                                             aliases(self.model))

    def _check_evaluation(self) -> None:
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
            n = check_items(self.eval_dataset, "eval_dataset", self.target_key, self.collate_fn)
            assert n is not None
            object.__setattr__(self, "n_eval_items", n)
            if n < self.batch_size:
                raise ValueError(f"eval_dataset has {n} items, fewer than one minibatch of {self.batch_size}; give more "
                                 "items or a smaller batch_size")

    @property
    def stream(self) -> bool:
        """Whether the dataset is read in order (:mod:`pipetrain.streams`)."""
        return is_stream(self.dataset)

    def epoch_minibatches(self, rounds: int) -> int:
        """Minibatches of a whole epoch, in whole rounds of ``rounds`` (a stream of unknown length: as
        many as ``max_steps`` allows)."""
        if self.n_items is None:
            assert self.max_steps is not None
            return self.max_steps // rounds * rounds
        return per_epoch(self.n_items, self.batch_size, rounds)

    def minibatches(self, epoch: int, rounds: int) -> int:
        """Minibatches of ``epoch``: a whole epoch's, fewer where ``max_steps`` ends the run in it, 0 after."""
        k = self.epoch_minibatches(rounds)
        if self.max_steps is None:
            return k
        return max(0, min(k, (self.max_steps - epoch * k) // rounds * rounds))

    def order(self, epoch: int, rounds: int) -> list[list[int]]:
        """Dataset indices (a stream's positions) of each minibatch of ``epoch`` (:meth:`minibatches` of
        them); empty once ``max_steps`` is reached."""
        k = self.minibatches(epoch, rounds)
        if self.n_items is None:
            return [list(range(t * self.batch_size, (t + 1) * self.batch_size)) for t in range(k)]
        return epoch_order(self.n_items, self.batch_size, epoch, self.shuffle and not self.stream, self.seed,
                           rounds)[:k]

    def epochs_run(self, rounds: int) -> int:
        """Epochs that make an update: ``epochs``, or fewer where ``max_steps`` ends the run sooner."""
        return sum(1 for epoch in range(self.epochs) if self.minibatches(epoch, rounds))

    def steps(self, rounds: int, first_epoch: int = 0) -> int:
        """Updates from ``first_epoch`` to the end (the minibatches of those epochs, up to ``max_steps``)."""
        return sum(self.minibatches(epoch, rounds) for epoch in range(first_epoch, self.epochs))

    def without_model(self) -> Training:
        """This training as it travels to a worker: without the model, whose stages travel on their own
        (:mod:`pipetrain.runtime.parts`)."""
        training = copy.copy(self)
        object.__setattr__(training, "model", None)
        return training


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How the job runs: checkpoints, restarts, timeouts, threads and what it records (the arguments of
    :func:`pipetrain.train` of that name; ``trace`` there may be a directory: ``trace_dir`` here)."""

    checkpoint_dir: str | None = None
    resume: bool = False
    keep_checkpoints: int | None = 2
    max_restarts: int = 0
    timeout: float = 300.0
    threads: int | None = None
    trace: bool = False
    trace_dir: str | None = None
    progress: bool = False
    log_dir: str | None = None
    backend: str = "auto"
    loader_workers: int = 0
    prefetch: int = 2
    save: str | None = None

    def __post_init__(self) -> None:
        if self.keep_checkpoints is not None and (isinstance(self.keep_checkpoints, bool) or
                                                  not isinstance(self.keep_checkpoints, int) or
                                                  self.keep_checkpoints < 2):
            raise ValueError(f"keep_checkpoints={self.keep_checkpoints!r}: keep at least 2 (a worker may be one "
                             "epoch ahead of another, so resuming needs the previous epoch) or None for all")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (where the workers saved themselves)")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r}: give how many times to restart, 0 or more")
        if self.max_restarts and self.checkpoint_dir is None:
            raise ValueError("max_restarts needs checkpoint_dir: a restarted job resumes from the workers' checkpoints")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r}: give the seconds a worker waits on a silent peer (> 0)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: use one of {', '.join(map(repr, BACKENDS))}")
        for name, least in (("loader_workers", 0), ("prefetch", 1)):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                raise ValueError(f"{name}={n!r}: give an integer >= {least} (loader_workers: background processes "
                                 "building each worker's minibatches, 0 builds them inline; prefetch: minibatches "
                                 "each loader keeps ready)")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads={self.threads!r}: give the torch threads per worker, at least 1 (or None: "
                             "the cores shared by the workers)")


@dataclass(frozen=True)
class Tie:
    """A parameter that layers of several stages read (tied weights): each of those stages holds a copy.

    The first of them owns it: its optimizer updates it with the sum of every copy's gradient and sends
    the new value to the others (:mod:`pipetrain.runtime.tied`)."""

    name: str  # the parameter's first name in the model
    stages: tuple[int, ...]
    names: tuple[str, ...] = ()  # every name of it in the model, the first first

    def __post_init__(self) -> None:
        if not self.names:
            object.__setattr__(self, "names", (self.name,))


@dataclass(frozen=True)
class JobConfig:
    """Everything every rank needs, validated once (``__post_init__``) before any process starts.

    Attributes:
        training: what is trained.
        run: how the job runs.
        strategy: a data-parallel strategy, or :class:`~pipetrain.strategies.kinds.Pipeline`.
        schedule: the pipeline's schedule; None for data parallelism.
        layout: the workers of each stage (one stage, sharded, for data parallelism).
        layers: the model cut into layers, where the caller has it (a pipeline's stages are checked
            against it; made here when not given). An init-only argument: the configuration does not
            hold it, as every worker cuts its own copy of the model.
        ties: the parameters several stages read (found from ``layers``); () for data parallelism.
        fingerprint: the model's (:func:`pipetrain.runtime.checkpoint.fingerprint`), taken once: a
            worker is never sent the model.
        gathers: the trained model comes back whole to the caller (``TrainResult.model``): the model was
            given with real weights. A model built on the meta device fits nowhere whole, so it is not
            gathered; ``save`` writes it stage by stage.
    """

    training: Training
    run: RunOptions
    strategy: Strategy
    schedule: PipelineSchedule | None
    layout: Layout
    layers: InitVar[LayeredModel | None] = None
    ties: tuple[Tie, ...] = field(default=(), init=False)
    fingerprint: str = field(default="", init=False)
    gathers: bool = field(default=True, init=False)

    def __post_init__(self, layers: LayeredModel | None) -> None:
        t, layout = self.training, self.layout
        object.__setattr__(self, "fingerprint", checkpoint.fingerprint(t.model))
        object.__setattr__(self, "gathers", not is_meta(t.model))
        if self.run.save is not None:
            check_save(self.run.save, self.gathers)
        if not isinstance(self.strategy, Strategy):
            raise ValueError(f"strategy {self.strategy!r} must be resolved to one strategy before the job is made")
        if self.strategy.data_parallel:
            if not layout.sharded or self.schedule is not None:
                raise ValueError(f"strategy {self.strategy.name!r} shares each minibatch over its workers; it takes "
                                 "workers=N, not stages or a schedule")
            if t.batch_size % layout.world:
                raise ValueError(f"batch_size {t.batch_size} does not split into {layout.world} equal shards; use a "
                                 f"multiple of {layout.world} (each worker takes batch_size / workers samples)")
            self.strategy.check_model(t.model)
        else:
            if layout.sharded or layout.boundaries is None or self.schedule is None:
                raise ValueError("a pipeline needs stages and a schedule")
            self.schedule.check_layout(layout)
            if t.batch_size % self.schedule.microbatches:
                raise ValueError(f"batch_size {t.batch_size} is not divisible by microbatches "
                                 f"{self.schedule.microbatches}; pick a batch size that splits evenly")
            self._check_stages(layers if layers is not None else LayeredModel(t.model, self.example()))
            if self.looped:
                self._check_looped()
        if t.n_items is not None and t.n_items < t.batch_size * layout.rounds:
            raise ValueError(f"the dataset has {t.n_items} items, fewer than one round of minibatches "
                             f"({t.batch_size * layout.rounds}); use a smaller batch_size")
        if t.max_steps is not None and t.max_steps < layout.rounds:
            raise ValueError(f"max_steps={t.max_steps} is fewer than one round of minibatches ({layout.rounds}, one for "
                             "each replica); give at least that many")

    def _check_stages(self, layers: LayeredModel) -> None:
        assert self.layout.boundaries is not None and self.schedule is not None
        check_boundaries(list(self.layout.boundaries), len(layers))
        names = aliases(self.training.model)
        ties = tuple(Tie(name, tuple(stages), names.get(name, (name,))) for name, stages in
                     layers.shared_parameters(list(self.layout.boundaries)).items())
        for tie in ties:
            replicated = [s for s in tie.stages if self.layout.replicas[s] > 1]
            if replicated:
                raise ValueError(f"parameter {tie.name} is tied across stages {list(tie.stages)}, and stage "
                                 f"{replicated[0]} is replicated; a tied parameter needs one worker on each stage "
                                 "that uses it: replicate other stages, or cut so one stage holds every use")
            if any(self.policy_name(s) == "naive" for s in tie.stages):
                raise ValueError(f"parameter {tie.name} is tied across stages {list(tie.stages)}, and schedule "
                                 f"{self.schedule.name!r} recomputes each backward with whatever weights are "
                                 "current, so the copies' gradients have no version to agree on; use pipedream")
        object.__setattr__(self, "ties", ties)

    def _check_looped(self) -> None:
        """What a schedule whose workers hold several stages cannot run yet (tied parameters), refused in one
        line."""
        assert self.schedule is not None
        if self.ties:
            raise ValueError(f"schedule {self.schedule.name!r} does not run tied parameters yet (parameter "
                             f"{self.ties[0].name} is read by stages {list(self.ties[0].stages)}); cut so one stage "
                             "holds every use, or use '1f1b-flush' (one stage per worker)")

    @property
    def data_parallel(self) -> bool:
        return self.strategy.data_parallel

    @property
    def looped(self) -> bool:
        """Its workers hold several stages each, round robin (``interleaved-1f1b``)."""
        return self.schedule is not None and self.schedule.looped

    @property
    def world(self) -> int:
        return self.layout.world if self.schedule is None else self.schedule.world(self.layout)

    @property
    def savers(self) -> int:
        """Checkpoint files per epoch: one per worker, or per stage where a worker holds several."""
        return self.layout.num_stages if self.looped else self.world

    def worker_name(self, rank: int) -> str:
        """How messages name ``rank``: its stage (:meth:`pipetrain.layout.Layout.name`), or the stages it holds."""
        if not self.looped:
            return self.layout.name(rank)
        return f"worker {rank} (stages {', '.join(map(str, range(rank, self.layout.num_stages, self.world)))})"

    @property
    def microbatches(self) -> int:
        return 1 if self.schedule is None else self.schedule.microbatches

    @property
    def threads(self) -> int:
        """Torch threads per worker: as given, else this machine's cores shared by its workers."""
        return self.run.threads if self.run.threads is not None else shared_cores(self.world)

    def example(self) -> Any:
        """The model input of the first minibatch (microbatch) in dataset order: what ``torch.export``
        captures a model that fx cannot trace on, for the shapes a stage sees
        (:class:`pipetrain.layers.LayeredModel`)."""
        return self.example_of(self.training, self.microbatches)

    @staticmethod
    def example_of(t: Training, microbatches: int) -> Any:
        """The model input of ``t``'s first microbatch (of ``microbatches`` per minibatch)."""
        return first_inputs(t.dataset, t.batch_size // microbatches, t.target_key, t.collate_fn)

    def identity(self) -> dict[str, Any]:
        """The job a checkpoint says saved it: its model (which a job resuming it must share), strategy,
        world size, layout, and the files it saves per epoch."""
        layout = {"workers": self.world} if self.data_parallel else {
            "boundaries": list(self.layout.boundaries or ()), "replicas": list(self.layout.replicas)}
        return {"model": self.fingerprint, "strategy": self.strategy.name,
                "world": self.world, "layout": layout, "savers": self.savers}

    def without_model(self) -> JobConfig:
        """This configuration as it travels to a worker: without the model, whose stages travel on their own
        (:mod:`pipetrain.runtime.parts`)."""
        cfg = copy.copy(self)
        object.__setattr__(cfg, "training", self.training.without_model())
        return cfg

    def stage_indices(self, rank: int) -> list[int]:
        """The stages ``rank`` holds: one, or every ``world``-th for a looped schedule."""
        return list(range(rank, self.layout.num_stages, self.world)) if self.looped else [self.layout.stage_of(rank)]

    def stages_of(self, rank: int, num_layers: int) -> list[tuple[int, int, int]]:
        """``(stage, first layer, last layer)`` of each stage ``rank`` holds, in a model of ``num_layers`` layers."""
        return [(s, *self.layout.layer_range(s, num_layers)) for s in self.stage_indices(rank)]

    def schedule_for(self, epoch: int, minibatches: int) -> Schedule:
        """The action lists of ``epoch``, with ``minibatches`` minibatches."""
        if self.schedule is None:
            return self.strategy.build(self.world, minibatches, epoch)
        return self.schedule.build(self.layout.replicas, minibatches)

    def policy_name(self, stage: int) -> str:
        """The weight policy of ``stage``'s workers (:data:`pipetrain.runtime.weights.POLICIES`)."""
        return "live" if self.schedule is None else self.schedule.policy(self.layout, stage)


def shared_cores(workers: int) -> int:
    """Torch threads per worker when not given: this machine's cores shared by its workers (torchrun's
    ``LOCAL_WORLD_SIZE`` of them, else all ``workers``)."""
    return max(1, (os.cpu_count() or 1) // local_workers(workers))


def check_request(strategy: Strategy | Auto, schedule: PipelineSchedule | str | None, stages: Any, workers: Any,
                  bandwidth: Any) -> None:
    """The choices of ``pipetrain.train`` that say where the work goes, checked together before anything is
    measured or planned: each strategy takes its own of ``schedule``, ``stages``, ``workers`` and
    ``bandwidth``."""
    planning = isinstance(stages, str) and stages == "auto"
    if isinstance(strategy, Auto) or strategy.data_parallel:
        given = [n for n, v in (("stages", stages), ("schedule", schedule)) if v is not None]
        if given and isinstance(strategy, Auto):
            raise ValueError(f"strategy='auto' chooses {', '.join(given)} itself; drop {given[0]}, or name a strategy")
        if given:
            raise ValueError(f"{given[0]} applies to strategy 'pipeline', not {strategy.name!r}; leave it out or "
                             "change the strategy")
        if bandwidth is not None and not isinstance(strategy, Auto):
            raise ValueError(f"bandwidth={bandwidth!r} is only used to plan (stages='auto') or to choose "
                             "(strategy='auto'); drop it")
        if workers is None:
            what = "the workers to choose for" if isinstance(strategy, Auto) else \
                "the data-parallel workers, each holding the whole model"
            raise ValueError(f"strategy={strategy.name!r} needs workers=N (CLI: --workers N), {what}")
        Layout.data_parallel_on(workers)
        return
    if stages is None:
        raise ValueError("strategy='pipeline' needs stages: first layer indices, a plan, or 'auto' "
                         "(CLI: --stages 0,4 | --plan FILE | --plan auto --workers N)")
    if bandwidth is not None and not planning:
        raise ValueError(f"bandwidth={bandwidth!r} is only used to plan with stages='auto'; drop it (a plan file "
                         "was made for its own bandwidth)")
    if planning:
        if workers is None:
            raise ValueError("stages='auto' needs workers=N (CLI: --workers N), the number of workers to plan for")
        Layout.data_parallel_on(workers)
    elif not isinstance(stages, (str, os.PathLike, Plan)):
        if isinstance(stages, (int, float)) or not all(isinstance(b, (int, str)) and not isinstance(b, bool)
                                                       for b in stages):
            raise ValueError(f"stages={stages!r}: give the first layer index of each stage as integers, e.g. "
                             "[0, 3, 7], or the submodule each later stage begins at, e.g. ['transformer.h.2', "
                             "'transformer.h.4']")
        if workers is not None and not (isinstance(schedule, PipelineSchedule) and schedule.looped):
            raise ValueError(f"workers={workers} is given beside explicit stages, which place one worker per stage; "
                             "drop workers, or plan with stages='auto'")
    if isinstance(schedule, PipelineSchedule) and schedule.looped and isinstance(stages, (str, os.PathLike, Plan)):
        raise ValueError(f"schedule {schedule.name!r} takes stages as first layers (a multiple of the workers) and "
                         "workers=W, each worker holding every W-th stage; a plan places one stage per worker")
