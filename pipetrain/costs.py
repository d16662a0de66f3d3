"""Every cost formula taken from the papers, in one place.

Each function names its paper, section and equation, and says where the code departs from it. The
functions use only arithmetic and ``numpy.maximum``, so they take floats or numpy arrays alike: the
partitioner calls them on whole tables at once.

Units: seconds, bytes, bytes per second.

PipeDream: Harlap et al., "PipeDream: Fast and Efficient Pipeline Parallel DNN Training",
arXiv:1806.03377.
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np

from pipetrain.schedule.generators import warmup

Num = TypeVar("Num", float, np.ndarray)

SYNC_ALGORITHMS = ("ps", "ring")


def dp_sync_bytes(parameter_bytes: Num, replicas: Num, algorithm: str = "ps") -> Num:
    """Bytes one worker sends and receives to synchronize a stage's weights over its replicas.

    PipeDream §3.2 (profiling paragraph): with a parameter server, each of m workers moves
    ``4 (m - 1) |w| / m`` bytes. ``algorithm="ring"`` uses the ring allreduce volume
    ``2 (m - 1) |w| / m`` instead (reduce-scatter then allgather, Patarasuk & Yuan 2009); the paper
    does not use it. One replica moves nothing.

    Args:
        parameter_bytes: |w|, the stage's parameter bytes.
        replicas: m, workers of the stage.
        algorithm: ``ps`` (parameter server, the paper's) or ``ring``.
    """
    if algorithm not in SYNC_ALGORITHMS:
        raise ValueError(f"unknown sync algorithm {algorithm!r}; use one of {', '.join(SYNC_ALGORITHMS)}")
    factor = 4 if algorithm == "ps" else 2
    return factor * (replicas - 1) * parameter_bytes / replicas


def stage_time(compute_s: Num, sync_s: Num, replicas: Num) -> Num:
    """T(i -> j, m) = max(sum of T_l, sum of W_l^m) / m, PipeDream §3.2.

    The seconds per minibatch of a stage of layers i..j replicated on m workers: the replicas take
    minibatches round-robin, so the stage finishes one every 1/m of its compute time, unless weight
    synchronization takes longer. The max assumes sync overlaps compute completely; the paper divides
    the sync term by m too, and so does the code.

    Args:
        compute_s: sum over the stage's layers of forward + backward seconds (T_l).
        sync_s: sum over the stage's layers of weight-sync seconds (W_l^m), i.e.
            ``dp_sync_bytes(...) / bandwidth``.
        replicas: m.
    """
    return np.maximum(compute_s, sync_s) / replicas


def boundary_time(cut_bytes: Num, bandwidth: Num) -> Num:
    """2 * C_i, PipeDream §3.2 recurrence for A(j, m): activations of the cut after layer i go
    forward and their gradients (same size) come back, each taking C_i = a_i / bandwidth.

    The paper charges this once per boundary, whatever the replication of the stages beside it;
    so does the code.
    """
    return 2 * cut_bytes / bandwidth


def in_flight(replicas: int, workers_to_output: int) -> int:
    """Minibatches a replica of a stage holds in flight under PipeDream's 1F1B schedule.

    PipeDream §3.2 gives NOAM = ceil(workers / workers of the input stage) for the input stage; the
    same reasoning for a later stage counts the workers from it to the output stage. This is
    :func:`pipetrain.schedule.generators.warmup`, used so the planner and the schedule agree.

    Args:
        replicas: workers of the stage.
        workers_to_output: workers of this stage and every later one.
    """
    return warmup((replicas, workers_to_output - replicas), 0)


def stage_memory_bytes(parameter_bytes: Num, stashed_activation_bytes: Num, in_flight_count: Num) -> Num:
    """Bytes one replica of a stage holds: live weights, one stashed weight version per in-flight
    minibatch (PipeDream §3.4, weight stashing) and the activations each in-flight minibatch keeps
    for its backward pass.

    PipeDream states the memory limit without a formula; its released optimizer uses
    ``ceil(...) * (activations + weights)``. This counts the live weights as well and leaves out
    gradients and optimizer state, so give the limit less the memory those take.

    Args:
        parameter_bytes: the stage's parameter bytes.
        stashed_activation_bytes: bytes one minibatch keeps on the stage until its backward.
        in_flight_count: from :func:`in_flight`.
    """
    return parameter_bytes * (1 + in_flight_count) + stashed_activation_bytes * in_flight_count
