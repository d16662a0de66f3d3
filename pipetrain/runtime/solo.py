"""One worker of a job run alone, its neighbours answering at once: what a stage's own code costs.

:func:`run_stage_alone` builds one rank's worker with the job's own builder
(:func:`pipetrain.runtime.job.build_worker`: stage module, optimizer, weight policy, data loading),
runs its real action list for one epoch in this process and returns the trace. Nothing waits and
nothing competes for the machine, so each action costs what the runtime's code path costs on the
device: the layers, plus stashing, gradient accumulation, batch building and allocation, but no
transfer.

* A receive returns at once with a fresh copy of one (micro)batch's real cut tensors (shapes,
  dtypes and values from one forward and backward of the whole model beforehand, see
  :func:`_cut_tensors`); activations carry the weight version the input stage would stamp (what
  vertical sync runs by), counted from its action list.
* A send is dropped.
* Gradient syncs (``A``, ``S``) complete at once: each replica keeps its own gradient, and no
  synchronizer wraps the stage or hooks its backward (as DDP's would).
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from pipetrain.layers import LayeredModel, flatten, received, unflatten
from pipetrain.runtime.job import JobConfig, build_worker, prepare_process
from pipetrain.runtime.parts import Source, build, local_parts
from pipetrain.runtime.transport import Message
from pipetrain.batches import call, collate_parts, microbatch, to_device
from pipetrain.streams import head
from pipetrain.timing import torch_threads
from pipetrain.schedule import Schedule
from pipetrain.schedule.actions import FORWARD, SYNC, UPDATE
from pipetrain.strategies.base import GradSync
from pipetrain.trace import Record


def run_stage_alone(cfg: JobConfig, stage: int, minibatches: int | None = None, *, replica: int = 0,
                    device: torch.device | str | None = None) -> list[Record]:
    """Run one worker of ``cfg`` alone for the first ``minibatches`` of epoch 0; return its trace.

    Like a worker process, it tells malloc to keep freed memory (for good: see
    :func:`pipetrain.runtime.launch.keep_freed_memory`) and runs with ``cfg.threads`` torch threads
    and torch's random generator seeded with the job's seed; the thread count and random state are
    given back afterwards. For timings a worker would see, call it in a fresh process (a worker's heap
    starts fresh). No process group is needed. The caller's model is not changed: the worker trains a
    copy, as a worker process does.

    Args:
        cfg: the job, its plan resolved (``boundaries`` set for a pipeline). Checkpoints are neither
            read nor written, and the trace is taken whatever ``cfg.run.trace`` says.
        stage: the worker's stage (0 for data parallelism).
        minibatches: how many minibatches, from the start of epoch 0 (default: the whole epoch); a
            multiple of ``cfg.layout.rounds``.
        replica: which of the stage's workers (data parallelism: which worker).
        device: where to run (default: the first GPU if there is one, else the CPU).

    Returns:
        The worker's ``(action_text, start_s, end_s)`` records in its schedule's order
        (``time.perf_counter`` seconds), as ``pipetrain.train(..., trace=True)`` returns per rank.

    Raises:
        ValueError: the plan is not resolved, the schedule holds several stages per worker, or ``stage``,
            ``replica`` or ``minibatches`` are outside the job.
    """
    t, layout = cfg.training, cfg.layout
    if cfg.looped:
        raise ValueError("a schedule of several stages per worker does not run a stage alone; time it under one of "
                         "one stage per worker, e.g. '1f1b-flush'")
    if not 0 <= stage < layout.num_stages or not 0 <= replica < layout.replicas[stage]:
        raise ValueError(f"stage {stage} replica {replica} is not in this job (workers per stage: "
                         f"{list(layout.replicas)})")
    rounds, order = layout.rounds, t.order(0, layout.rounds)
    whole = len(order)
    minibatches = whole if minibatches is None else minibatches
    if not 1 <= minibatches <= whole or minibatches % rounds:
        raise ValueError(f"minibatches={minibatches}: give a multiple of {rounds} from {rounds} to "
                         f"{whole} (an epoch of this dataset)")
    where = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    job = replace(cfg, training=replace(t, model=copy.deepcopy(t.model)),
                  run=replace(cfg.run, trace=True, resume=False, max_restarts=0, checkpoint_dir=None, progress=False,
                              log_dir=None),
                  layers=None)
    rank = layout.first_rank(stage) + replica
    batches = order[:minibatches]
    schedule = job.schedule_for(0, minibatches)
    # prepare_process sets the job's thread count; this process gets its own back after
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), torch_threads(None):
        prepare_process(job)
        channel = _Instant(schedule, stage, *_cut_tensors(job, stage, batches[0], schedule.microbatches, where))
        sync = GradSync() if any(a.kind == SYNC for a in schedule.actions[rank]) else None
        layers = None if job.data_parallel else LayeredModel(job.training.model, job.example())
        source = Source.of(job.training.model, None, t.seed)
        [part] = local_parts(layers, job.training.model, job.stages_of(rank, len(layers)) if layers else [], source)
        worker = build_worker(job, rank, where, channel, sync, build(part, source, where), exchange_ties=False,
                              layers=part.layers)
        worker.log = None  # no history file, even inside a launched process
        worker.run_epoch(schedule, 0, batches, 0)
    assert worker.trace is not None
    return worker.trace


class _Instant:
    """A :class:`pipetrain.runtime.transport.Channel` whose receives return at once and sends vanish.

    Args:
        schedule: the job's schedule (who is upstream, and the input stage's action lists).
        stage: the stage of the worker it serves.
        activations: the tensors one (micro)batch brings into ``stage``, or None at the input stage.
        gradients: the gradients of ``stage``'s outputs for one (micro)batch, or None at the output stage.
    """

    def __init__(self, schedule: Schedule, stage: int, activations: Message | None,
                 gradients: Message | None) -> None:
        self.schedule, self.stage = schedule, stage
        self.activations, self.gradients = activations, gradients
        self.versions = _input_versions(schedule)

    def send(self, peer: int, msg: Message) -> None:
        pass

    def recv(self, peer: int, mb: int, micro: int | None, what: str, channel: int = 0) -> Message:
        upstream = self.schedule.stage_of(peer) < self.stage
        sample = self.activations if upstream else self.gradients
        assert sample is not None, f"{what}: no neighbour sends that to stage {self.stage}"
        version = self.versions[(mb, micro)] if upstream else 0
        return Message(mb, micro, version, [t.clone() for t in sample.tensors], sample.is_tuple)


def _input_versions(schedule: Schedule) -> dict[tuple[int, int | None], int]:
    """(minibatch, microbatch) -> the input stage's weight version at its forward (the version a
    message carries), from the input stage's action lists: a replica's update adds the replica count."""
    out = {}
    for w in range(schedule.replicas[0]):
        updates = 0
        for a in schedule.actions[w]:
            if a.kind == UPDATE:
                updates += 1
            elif a.kind == FORWARD:
                out[(a.mb, a.micro)] = updates * schedule.replicas[0]
    return out


def _cut_tensors(cfg: JobConfig, stage: int, items: list[int], m: int,
                 device: torch.device) -> tuple[Message | None, Message | None]:
    """One (micro)batch's activations into ``stage`` and gradients of its outputs, from one forward and
    backward of the whole model on the first (micro)batch of ``items``.

    The model runs in eval mode (no batch statistics or dropout change; shapes are the same) and
    gradients are taken for the cut only, so no parameter's ``.grad`` changes. The model is left on
    the CPU; the worker moves its stage to ``device``, as a worker holds its stage only.
    """
    if cfg.layout.boundaries is None or len(cfg.layout.boundaries) == 1:
        return None, None  # one stage: nothing crosses a cut
    model = cfg.training.model
    modes = {mod: mod.training for mod in model.modules()}
    model.eval().to(device)
    try:
        micro = 0 if m > 1 else None
        t = cfg.training
        x, target = (microbatch(to_device(value, device), micro, m)
                     for value in collate_parts(head(t.dataset, max(items) + 1), items, (0, 1), t.target_key,
                                                t.collate_fn))
        parts = list(LayeredModel(model, x).stages(list(cfg.layout.boundaries)))
        with torch.no_grad():
            for part in parts[:stage]:
                x = call(part, x)
            activations = gradients = None
            if stage > 0:
                activations = Message(0, micro, 0, *flatten(x))
                x = unflatten(received(activations.tensors, False)[1], activations.is_tuple)  # changed in place?
            out = call(parts[stage], x)
        if stage < len(parts) - 1:
            tensors, is_tuple = flatten(out)
            leaves, fed = received(tensors, True)
            y: Any = unflatten(fed, is_tuple)
            for part in parts[stage + 1:]:
                y = part(y)
            floats = [t for t in leaves if t.is_floating_point()]
            grads = torch.autograd.grad(cfg.training.loss_fn(y, target), floats, allow_unused=True)
            gradients = Message(0, micro, 0, [torch.zeros_like(t) if g is None else g for t, g in zip(floats, grads)],
                                False)
    finally:
        for mod, training in modes.items():
            mod.training = training
        model.cpu()
    return activations, gradients

