"""Gradient synchronizers: how the workers of one stage agree on a gradient before they step."""
from pipetrain.strategies.allreduce import ReplicaAllreduce

__all__ = ["ReplicaAllreduce"]
