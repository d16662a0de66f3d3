"""pipetrain: pipeline-parallel (PipeDream), CPU-GPU data-parallel and Pipe-SGD training.

This module is the public API, kept narrow (``__all__``): :func:`train` and what it returns, the
strategy and schedule classes it takes, and the profile -> plan -> simulate tools that
``stages="auto"`` and ``strategy="auto"`` are built from, and :func:`materialize`, which gives a model
built on the meta device the initial weights its pipeline workers give their stages. The rest of the
package is internal.
"""
from pipetrain.api import train
from pipetrain.errors import PipetrainError, PipetrainWarning
from pipetrain.initialize import InitError, materialize
from pipetrain.layers import LayerError, LayeredModel
from pipetrain.metrics import accuracy
from pipetrain.planning import Plan, plan
from pipetrain.profiling import Profile
from pipetrain.profiling import profile_model as profile
from pipetrain.registry import (
    CGDP, DDP, Auto, GPipe, Interleaved1F1B, ModelParallel, Naive, OneFOneBFlush, PipeDream, PipeSGD, Pipeline,
    TwoBW, ZeroBubble, build_data_parallel, build_schedule,
)
from pipetrain.result import TrainResult
from pipetrain.runtime.checkpoint import CheckpointError
from pipetrain.runtime.checkpoint import assemble as load_checkpoint
from pipetrain.schedule import Action, Schedule
from pipetrain.simulate import Link, SimResult, simulate

__all__ = ["train", "TrainResult", "profile", "Profile", "plan", "Plan", "simulate", "SimResult", "Link",
           "load_checkpoint", "materialize", "InitError", "LayeredModel", "LayerError", "PipetrainError",
           "PipetrainWarning", "CheckpointError",
           "Schedule", "Action", "build_schedule", "build_data_parallel", "accuracy",
           "Pipeline", "DDP", "PipeSGD", "CGDP", "Auto", "PipeDream", "Naive", "GPipe", "OneFOneBFlush",
           "ModelParallel", "ZeroBubble", "Interleaved1F1B", "TwoBW"]
