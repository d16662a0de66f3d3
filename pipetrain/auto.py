"""``stages="auto"`` and ``strategy="auto"``: measure the model and this machine, then plan or choose.

Under torchrun the measuring runs on rank 0 only and the others take its result (plain data), so
timing noise cannot give ranks different plans.
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.batches import collate_parts, to_device
from pipetrain.streams import head
from pipetrain.config import RunOptions, Training, shared_cores
from pipetrain.errors import one_line
from pipetrain.initialize import InitError
from pipetrain.layers import LayerError
from pipetrain.planning import Plan, plan
from pipetrain.planning.choose import Choice, choose_strategy
from pipetrain.planning.schedules import ScheduleChoice, choose_schedule
from pipetrain.predict.pipeline import best_plan, predict_plan, propose
from pipetrain.planning.units import parse_bandwidth
from pipetrain.profiling import Profile, as_minibatch, profile_model, time_batching
from pipetrain.registry import PipelineSchedule, Strategy, make
from pipetrain.setup import layer_step, measure_setup, model_step
from pipetrain.timing import torch_threads
from pipetrain.runtime.dist import init_distributed
from pipetrain.runtime.launch import under_torchrun
from pipetrain.runtime.parts import Source, is_meta
from pipetrain.runtime.resident import baseline, model_modules
from pipetrain.simulate import Link

DEFAULT_BANDWIDTH = "10Gbit"
"""The link speed ``stages="auto"`` plans for when no bandwidth is given."""


@dataclass(frozen=True)
class Chosen:
    """What ``strategy="auto"`` picked: the strategy with its options, the pipeline's schedule and
    plan (None for data parallelism), and the whole choice (``Choice.to_dict()``) with its prediction."""

    strategy: Strategy
    schedule: PipelineSchedule | None
    plan: Plan | None
    choice: dict[str, Any]


def on_rank0(work: Callable[[], dict[str, Any]], run: RunOptions) -> dict[str, Any]:
    """``work()`` here; under torchrun on rank 0 only, the others taking its result (plain data)."""
    if not under_torchrun():
        return work()
    init_distributed(run.timeout, run.backend)
    box: list[Any] = [work() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


PROFILE_LAYER_S = 1.0
"""The seconds a layer's profiling may take before it runs fewer times (``layer_seconds`` of
:func:`pipetrain.profiling.profile_model`); a small model's layers never come near it."""

STAND_IN_STEP_S = 0.25
"""A model whose training step (its profile's forward and backward) takes longer than this has the run
set-up measured with one of its layers standing in for the step (:func:`pipetrain.setup.layer_step`):
the probes call their kernel dozens of times, which at a step of seconds would take minutes."""

STAND_IN_S = 0.05
"""About how long the layer that stands in for a slow step takes: it runs on as few of the minibatch's
rows as take that long."""


def measured_profile(t: Training, run: RunOptions, workers: int, batch_size: int | None = None,
                     step_rows: int | None = None, ring_cpu: bool = True) -> Profile:
    """The model profiled on the first minibatch (of ``batch_size`` rows, default the job's) with the
    workers' thread count and optimizer, on the device the workers will train on (a GPU where the
    machine has one), one layer at a time (see [Note: one layer at a time] in
    :func:`pipetrain.profiling.profile_model`: a model built on the meta device is never whole), building a
    minibatch from the dataset timed (:func:`pipetrain.profiling.time_batching`) and priced with the
    run's ``loader_workers``, with the workers' process baseline (:func:`baseline_bytes`); with the run
    set-up of ``workers`` local workers measured (:func:`pipetrain.setup.measure_setup`), their shared
    work a training step on the minibatch's first ``step_rows`` samples (default: all; a data-parallel
    worker's shard prices that worker directly; one layer stands in for a slow step, see
    :data:`STAND_IN_STEP_S`, and always for a model on the meta device, which is never run whole), our
    ring's CPU timed unless ``ring_cpu`` is False (only pipe-sgd reads it). Under torchrun, whose
    workers this process does not start, no set-up is measured. ``meta`` records the seconds each took
    (``profile_s``, ``setup_s``; with ``t.compile`` the layers are profiled compiled, and ``compile_s`` is
    their compilation, timed apart from their step times). The set-up's probes run the eager step."""
    rows = t.batch_size if batch_size is None else batch_size
    threads = run.threads or shared_cores(workers)
    device = workers_device()
    meta = is_meta(t.model)

    def first(n: int) -> Any:
        items = head(t.dataset, n)
        return to_device(collate_parts(items, range(min(n, len(items))), (0, 1), t.target_key, t.collate_fn), device)

    batch = first(rows)
    begun = time.perf_counter()
    try:
        with torch_threads(threads):
            measured = profile_model(t.model, tuple(batch), t.loss_fn, optimizer=t.optimizer, repeats=5, warmup=2,
                                     layer_seconds=PROFILE_LAYER_S, weights=t.weights, seed=t.seed,
                                     compile=t.compile)
            measured.inputs_s, measured.targets_s, measured.both_s = time_batching(t.dataset, rows,
                                                                                   target_key=t.target_key,
                                                                                   collate_fn=t.collate_fn)
            measured.loaders = run.loader_workers
    except (LayerError, InitError):
        raise
    except Exception as e:  # the user's model, loss or optimizer on the user's data: say where it failed
        raise ValueError(f"the model failed on the dataset's first minibatch while pipetrain profiled it to plan: "
                         f"{one_line(e)}; check that the model, the loss and the dataset's samples "
                         "fit (dtype, shape)") from e
    measured.baseline_bytes = baseline_bytes(t, device, threads)
    measured.meta["profile_s"] = time.perf_counter() - begun - measured.meta.get("compile_s", 0.0)
    if not under_torchrun():
        begun = time.perf_counter()
        step = batch if step_rows is None else first(step_rows)
        layer_s = [x.forward_s + x.backward_s for x in measured.layers]
        slow = meta or sum(layer_s) * (step_rows or rows) / rows > STAND_IN_STEP_S
        with torch_threads(threads):
            kernel: Callable[[], Any] | None = layer_step(t.model, batch[0], layer_s, STAND_IN_S,
                                                          Source.of(t.model, t.weights, t.seed)) if slow else None
            if kernel is None and not meta:  # a meta model of under 3 layers: the probes' own kernel
                whole = copy.deepcopy(t.model).to(device) if device.type == "cuda" else t.model
                kernel = model_step(whole, tuple(step), t.loss_fn)
        measured.setup = measure_setup(workers, threads, kernel, ring_bytes=measured.parameter_bytes,
                                       ring_cpu=ring_cpu, backend=run.backend)
        measured.meta["setup_s"] = time.perf_counter() - begun
    return measured


def workers_device() -> torch.device:
    """Where the workers of a job started here train, and so where it is measured: a GPU where the
    machine has one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def baseline_bytes(t: Training, device: torch.device, threads: int) -> int:
    """What a worker of ``threads`` torch threads holds before its stage on ``device``: on the CPU its
    process, as the runtime starts one, with the modules of ``t``'s model imported and warmed up by a
    small step of ``t``'s optimizer (:func:`pipetrain.runtime.resident.baseline`); on a GPU nothing (its
    figure is the tensors allocated there)."""
    return 0 if device.type == "cuda" else baseline(model_modules(t.model), threads, t.optimizer)


def plan_stages(t: Training, run: RunOptions, schedule: PipelineSchedule, workers: int,
                bandwidth: float | str | None, phases: dict[str, float],
                memory: float | str | None = None) -> tuple[Plan, float | None]:
    """``stages="auto"``: the plan for ``workers`` (each worker within ``memory`` bytes, if given) and its
    predicted samples/s (on rank 0 under torchrun), the seconds of profiling, measuring the set-up and
    planning added to ``phases``."""
    found = on_rank0(lambda: _plan_here(t, run, schedule, workers, bandwidth or DEFAULT_BANDWIDTH, memory), run)
    phases.update(found["phases"])
    chosen = Plan.from_dict(found["plan"])
    say_fewer(chosen, workers)
    return chosen, found["predicted"]


def say_fewer(chosen: Plan | None, workers: int) -> None:
    """On rank 0, one line when a plan for fewer than the job's ``workers`` would run faster than
    ``chosen`` (its ``options["fewer_workers_faster"]``): the job keeps the workers it was given."""
    fewer = chosen.options.get("fewer_workers_faster") if chosen is not None else None
    if fewer and int(os.environ.get("RANK", "0")) == 0:
        print(f"pipetrain: a plan for {fewer['workers']} of the {workers} workers ({fewer['config']}) simulates "
              f"faster than any for all {workers}; `pipetrain plan` shows it, workers={fewer['workers']} runs it",
              flush=True)


def _plan_here(t: Training, run: RunOptions, schedule: PipelineSchedule, workers: int,
               bandwidth: float | str, memory: float | str | None = None) -> dict[str, Any]:
    """Profile, plan for ``bandwidth`` and predict this run's samples/s.

    [Note: one stage against the plan] The partitioner's model (PipeDream §3.2) lets a replicated
    stage's sync overlap its compute, so for a schedule that replicates stages the simulator picks among
    the partitioner's plans for the workers asked (:func:`pipetrain.predict.pipeline.best_plan`; where a
    plan for fewer workers simulates faster, the plan's ``options["fewer_workers_faster"]`` says which),
    and that plan is simulated beside every layer as one stage on all the workers, and the faster is taken
    (the plan's ``options["simulated_samples_per_s"]`` holds both).

    Each is simulated for an epoch of its schedule, filled and drained, as ``samples_per_s`` measures it
    (:func:`pipetrain.result.training_rate`), on the links this run has (the measured transport locally,
    ``bandwidth`` under torchrun), from a profile and set-up taken at the microbatch for a microbatched
    schedule (:func:`pipetrain.profiling.as_minibatch`)."""
    begun = time.perf_counter()
    measured = measured_profile(t, run, workers, ring_cpu=False)
    straight = not schedule.replicable
    link = Link(parse_bandwidth(bandwidth)) if under_torchrun() else Link()
    m = schedule.microbatches
    at = measured if m == 1 else as_minibatch(
        measured_profile(t, run, workers, batch_size=t.batch_size // m, ring_cpu=False), m)
    options: dict[str, Any] = {"memory": memory, "recompute": t.recompute, "schedule": schedule}
    if straight:
        candidates = [plan(measured, workers, bandwidth, straight=True, **options)]
    else:  # replicated stages: the simulator picks among the partitioner's plans for the workers asked
        candidates = [best_plan(at, propose(measured, workers, bandwidth, **options), link, t.batch_size,
                                schedule=schedule, every_worker=True)]
    if not straight and len(candidates[0].stages) > 1 and memory is None:  # one stage holds the whole model
        candidates.append(plan(measured, workers, bandwidth, one_stage=True))
    rates = [predict_plan(at, c, link, t.batch_size, schedule,
                          max(t.epoch_minibatches(math.lcm(*c.replicas)), 1), epoch=True)
             for c in candidates]
    best = max(range(len(candidates)), key=rates.__getitem__)
    chosen = candidates[best]
    if len(candidates) > 1:
        chosen.options["simulated_samples_per_s"] = {c.config: r for c, r in zip(candidates, rates)}
    measuring = [measured] if at is measured else [measured, at]
    phases = {key: sum(p.meta.get(key, 0.0) for p in measuring) for key in _phases(t)}
    phases["plan_s"] = time.perf_counter() - begun - sum(phases.values())
    return {"plan": chosen.to_dict(), "predicted": rates[best] or None, "phases": phases}


def _phases(t: Training) -> tuple[str, ...]:
    """The measuring phases ``TrainResult.phases`` reports: compiling the layers apart from profiling them."""
    return ("profile_s", "compile_s", "setup_s") if t.compile else ("profile_s", "setup_s")


def plan_schedule(t: Training, run: RunOptions, workers: int, bandwidth: float | str | None,
                  phases: dict[str, float], memory: float | str | None = None
                  ) -> tuple[PipelineSchedule, Plan, float, bool]:
    """``schedule="auto"`` with ``stages="auto"``: measure on rank 0, price every schedule at each
    microbatch count for the planned stages within ``memory`` bytes per worker
    (:func:`pipetrain.planning.schedules.choose_schedule`; every row recomputing where ``t.recompute``),
    print the table and the reason, and return the fastest schedule, its plan (the whole table in
    ``plan.options["schedules"]``), its predicted samples/s and whether it recomputes."""
    def work() -> dict[str, Any]:
        begun = time.perf_counter()
        measured = measured_profile(t, run, workers, ring_cpu=False)
        link = Link(parse_bandwidth(bandwidth or DEFAULT_BANDWIDTH)) if under_torchrun() else Link()
        found = choose_schedule(measured, workers, bandwidth or DEFAULT_BANDWIDTH, t.batch_size, memory=memory,
                                link=link, minibatches=max(t.epoch_minibatches(1), 1),
                                recompute=True if t.recompute else None, fewer_workers=False)
        spent = {key: measured.meta.get(key, 0.0) for key in _phases(t)}
        spent["plan_s"] = time.perf_counter() - begun - sum(spent.values())
        return {"choice": found.to_dict(), "phases": spent}

    found = on_rank0(work, run)
    phases.update(found["phases"])
    choice = ScheduleChoice.from_dict(found["choice"])
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"pipetrain: schedule auto\n{choice.table()}\n{choice.reason}", flush=True)
    chosen = choice.plan
    say_fewer(chosen, workers)
    chosen.options["schedules"] = found["choice"]
    return choice.schedule(), chosen, choice.chosen.samples_per_s or 0.0, choice.chosen.recompute


def choose(t: Training, run: RunOptions, workers: int, bandwidth: float | str | None,
           allow_compression: bool) -> Chosen:
    """``strategy="auto"``: measure on rank 0, predict every strategy, print the table and the reason,
    and return the fastest with its options."""
    one_machine = not under_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")

    def work() -> dict[str, Any]:
        shard = t.batch_size // workers if t.batch_size % workers == 0 else t.batch_size
        measured = measured_profile(t, run, workers, step_rows=shard)
        if measured.setup is not None:  # what the predictions below are priced with
            print(f"pipetrain: measured set-up: {measured.setup.describe()}", flush=True)
        if t.compile:
            print(f"pipetrain: profiled the compiled layers; compiling them took {measured.meta['compile_s']:.1f} s, "
                  "which no prediction counts", flush=True)
        return choose_strategy(measured, workers, bandwidth, batch_size=t.batch_size, one_machine=one_machine,
                               allow_compression=allow_compression, every_worker=True).to_dict()

    found = on_rank0(work, run)
    choice = Choice.from_dict(found)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"pipetrain: strategy auto\n{choice.table()}\n{choice.reason}", flush=True)
    picked = dict(choice.options[choice.choice])
    name, stages = picked.pop("strategy"), picked.pop("stages", None)
    say_fewer(stages, workers)
    schedule = make("schedule", picked.pop("schedule"), {}) if "schedule" in picked else None
    return Chosen(make("strategy", name, picked), schedule, stages, found)

