"""Predictions per data-parallel strategy, built on the simulator: Pipe-SGD and DDP
(:mod:`~pipetrain.predict.dataparallel`, Pipe-SGD eq. 2-7) and CGDP (:mod:`~pipetrain.predict.cgdp`, CGDP
eq. 1-2). Each takes explicit behaviour flags, never a strategy name.
"""
from pipetrain.predict.cgdp import CGDPPrediction, predict_cgdp
from pipetrain.predict.dataparallel import DataParallelPrediction, predict_data_parallel

__all__ = ["CGDPPrediction", "DataParallelPrediction", "predict_cgdp", "predict_data_parallel"]
