"""A profile priced per stage: what the simulator and the predictions charge for each stage's compute.

:func:`stage_costs` sums a profile's layers into stages at a batch size; :func:`shard_priced` and
:func:`shard_backward_s` price one worker's share of a minibatch (a data-parallel shard, or a
microbatch) from the run set-up's training step where it timed those rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipetrain import costs
from pipetrain.layers import check_boundaries, stages_of
from pipetrain.profiling import Profile


@dataclass(frozen=True)
class StageCost:
    """One stage's costs per minibatch, at the simulated batch size.

    Attributes:
        forward_s, backward_s: sums over the stage's layers.
        output_bytes: activations sent to the next stage (the last layer's ``activation_bytes``);
            the gradients sent back across that cut are the same size.
        stash_bytes: activations kept from forward to backward: the stage's input plus every
            layer's output (PipeDream §3.5's intermediate state, weights excluded).
        parameter_bytes: the stage's weights.
        update_s: the optimizer step on them (the profile's ``optimizer_s``; 0 if not measured).
        batching_s: building the minibatch from the dataset before its first forward: the inputs on
            the first stage, the targets on the last (:meth:`pipetrain.profiling.Profile.building_s`).
        weight_s: the part of ``backward_s`` that computes the weights' gradients (the layers'
            :attr:`~pipetrain.profiling.profile.LayerProfile.weight_s`); the rest computes the input's.
        input_bytes: the stage's input, received from the stage before (the model's input at the first).
        gradient_bytes, optimizer_bytes: its gradients and its optimizer's state (the layers'
            :attr:`~pipetrain.profiling.profile.LayerProfile.gradient_bytes` and ``optimizer_bytes``).
    """

    forward_s: float
    backward_s: float
    output_bytes: float
    stash_bytes: float
    parameter_bytes: int
    update_s: float = 0.0
    batching_s: float = 0.0
    weight_s: float = 0.0
    input_bytes: float = 0.0
    gradient_bytes: int = 0
    optimizer_bytes: int = 0

    def backward_part_s(self, kind: str) -> float:
        """Seconds of a whole backward (``"B"``), of its input-gradient part (``"I"``) or of its
        weight-gradient part (``"W"``)."""
        return {"B": self.backward_s, "I": self.backward_s - self.weight_s, "W": self.weight_s}[kind]

    def share(self, parts: int) -> StageCost:
        """The cost of 1/``parts`` of the minibatch (times, activations and the rows built scale,
        weights and their optimizer step do not)."""
        return replace(self, forward_s=self.forward_s / parts, backward_s=self.backward_s / parts,
                       output_bytes=self.output_bytes / parts, stash_bytes=self.stash_bytes / parts,
                       batching_s=self.batching_s / parts, weight_s=self.weight_s / parts,
                       input_bytes=self.input_bytes / parts)


def stage_costs(profile: Profile, boundaries: Sequence[int], batch_size: int | None = None) -> list[StageCost]:
    """Per-stage costs of ``profile`` cut at ``boundaries``.

    Args:
        profile: per-layer costs, measured at ``profile.batch_size``.
        boundaries: the first layer index of each stage, e.g. ``[0, 3, 7]``.
        batch_size: samples per minibatch; times and activation bytes are scaled linearly from the
            profiled batch size (an approximation: small batches use a device less well). A profile
            that does not state its batch size (0, as PipeDream's graph.txt files) is taken as
            measured at ``batch_size``.

    Returns:
        One StageCost per stage.

    Raises:
        LayerError: boundaries that do not cut the profile's layers into non-empty stages.
    """
    check_boundaries(list(boundaries), len(profile))
    scale = 1.0 if batch_size is None or profile.batch_size == 0 else batch_size / profile.batch_size
    ends = [*boundaries[1:], len(profile)]
    stages = []
    for first, end in zip(boundaries, ends):
        layers = profile.layers[first:end]
        inputs = profile.input_bytes if first == 0 else profile.layers[first - 1].activation_bytes
        stages.append(StageCost(
            forward_s=scale * sum(x.forward_s for x in layers),
            backward_s=scale * sum(x.backward_s for x in layers),
            output_bytes=scale * layers[-1].activation_bytes,
            stash_bytes=scale * (inputs + sum(x.activation_bytes for x in layers)),
            parameter_bytes=sum(x.parameter_bytes for x in layers), update_s=sum(x.optimizer_s for x in layers),
            batching_s=scale * profile.building_s(first, end), weight_s=scale * sum(x.weight_s for x in layers),
            input_bytes=scale * inputs, gradient_bytes=sum(x.gradient_bytes for x in layers),
            optimizer_bytes=sum(x.optimizer_bytes for x in layers)))
    return stages


def tied_stages(profile: Profile, boundaries: Sequence[int]) -> list[tuple[list[int], int]]:
    """For each parameter that layers of several stages read (:attr:`Profile.ties`), those stages and
    its bytes: the first owns it, and every update each other one sends it its gradient and gets the
    new value back."""
    out = []
    for layers, nbytes in profile.ties:
        stages = stages_of(layers, boundaries)
        if len(stages) > 1:
            out.append((stages, nbytes))
    return out


def shard_priced(profile: Profile, whole: StageCost, workers: int, batch_size: int | None) -> tuple[Profile, float]:
    """``profile`` with its set-up's ``slowdown`` as a worker's share of the minibatch measured it, and
    that slowdown.

    The slowdown is the set-up's training step at the share's rows
    (:attr:`pipetrain.setup.Setup.step_s`, timed in the workers, all at once) over the forward +
    backward of ``whole`` (the profile as one stage) split ``workers`` ways: a data-parallel worker's
    shard, a schedule's microbatches, or with 1 a worker that trains on whole minibatches (a one-stage
    pipeline's replicas). Without a step of those rows the profile is unchanged (slowdown 1 without a
    set-up). Building a minibatch from the dataset is not part of the step: its times are rescaled so
    that the new slowdown prices them at the set-up's own.

    Why the step: a CPU runs a smaller batch less well than the layer profile's batch suggests, and a
    layer profile taken in a few seconds of one process reads a VM's faster and slower phases, while
    the step, timed in the workers themselves over several rounds, varies less.
    """
    setup = profile.setup
    if setup is None:
        return profile, 1.0
    batch = profile.batch_size if batch_size is None else batch_size
    share = (whole.forward_s + whole.backward_s) / workers
    if setup.step_s <= 0 or setup.step_rows * workers != batch or share <= 0:
        return profile, setup.slowdown
    slowdown = setup.step_s / share
    keep = setup.slowdown / slowdown  # building a minibatch is not the step: it keeps the set-up's slowdown
    return replace(profile.building_scaled(keep), setup=replace(setup, slowdown=slowdown)), slowdown


def shard_backward_s(profile: Profile, whole: StageCost, workers: int, slowdown: float) -> list[float]:
    """Each layer's backward on one of ``workers`` data-parallel workers' shard of the minibatch (``whole``:
    the profile as one stage, at the minibatch), as long as it takes beside the machine's other workers
    (``slowdown``)."""
    scale = costs.contended_s(whole.share(workers).backward_s, slowdown) / \
        max(sum(x.backward_s for x in profile.layers), 1e-300)
    return [x.backward_s * scale for x in profile.layers]
