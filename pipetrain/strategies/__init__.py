"""Gradient synchronizers: how the workers of a stage agree on a gradient before they step.

One interface (:class:`GradSync`), called by the worker at the schedule's ``A`` and ``S`` actions:
a replicated pipeline stage's allreduce (:mod:`.allreduce`), PyTorch DDP (:mod:`.ddp`) and Pipe-SGD's
compressed ring on a communication thread (:mod:`.pipesgd`, :mod:`.ring`, :mod:`.compression`).
"""
from pipetrain.strategies.allreduce import ReplicaAllreduce
from pipetrain.strategies.base import GradSync, SyncContext

__all__ = ["GradSync", "SyncContext", "ReplicaAllreduce"]
