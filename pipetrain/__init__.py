"""pipetrain: pipeline-parallel (PipeDream), CPU-GPU data-parallel and Pipe-SGD training."""
from pipetrain.api import TrainResult, train
from pipetrain.layers import LayerError, LayeredModel
from pipetrain.runtime.launch import PipetrainError
from pipetrain.schedule import Action, Schedule, build_schedule

__all__ = ["train", "TrainResult", "LayeredModel", "LayerError", "PipetrainError", "Schedule", "Action",
           "build_schedule"]
