"""Gradient synchronizers: how the workers of a stage agree on a gradient before they step.

One interface (:class:`GradSync`), called by the worker at the schedule's ``A`` and ``S`` actions:
a replicated pipeline stage's allreduce (:mod:`.allreduce`), PyTorch DDP (:mod:`.ddp`), Pipe-SGD's
compressed ring on a communication thread (:mod:`.pipesgd`, :mod:`.ring`, :mod:`.compression`) and
CGDP's sums in shared host memory (:mod:`.cgdp`, :mod:`.chunks`).
"""
from pipetrain.strategies.allreduce import ReplicaAllreduce
from pipetrain.strategies.base import GradSync, SyncContext
from pipetrain.strategies.chunks import ChunkSearch, chunk_layout, search_length

__all__ = ["GradSync", "SyncContext", "ReplicaAllreduce", "ChunkSearch", "chunk_layout", "search_length"]
