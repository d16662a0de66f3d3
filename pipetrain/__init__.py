"""pipetrain: pipeline-parallel (PipeDream), CPU-GPU data-parallel and Pipe-SGD training."""
from pipetrain.api import TrainResult, train
from pipetrain.layers import LayerError, LayeredModel
from pipetrain.metrics import accuracy
from pipetrain.planning import Plan, plan
from pipetrain.profiling import Profile
from pipetrain.profiling import profile_model as profile
from pipetrain.runtime.checkpoint import CheckpointError
from pipetrain.runtime.checkpoint import assemble as load_checkpoint
from pipetrain.errors import PipetrainWarning
from pipetrain.errors import PipetrainError
from pipetrain.registry import build_data_parallel, build_schedule
from pipetrain.schedule import Action, Schedule
from pipetrain.simulate import Link, SimResult, simulate

__all__ = ["train", "TrainResult", "profile", "Profile", "plan", "Plan", "simulate", "SimResult", "Link",
           "load_checkpoint",
           "LayeredModel", "LayerError", "PipetrainError", "PipetrainWarning", "CheckpointError", "Schedule", "Action",
           "build_schedule",
           "build_data_parallel", "accuracy"]
