"""The run set-up: how a job's workers run on this machine (:class:`Setup`, the data a profile
carries) and the distributed probes that measure it (:func:`measure_setup`)."""
from pipetrain.setup.compute import LayerStep, ModelStep, layer_step, model_step
from pipetrain.setup.data import Setup
from pipetrain.setup.probes import Launcher, measure_setup

__all__ = ["LayerStep", "Launcher", "ModelStep", "Setup", "layer_step", "measure_setup", "model_step"]
