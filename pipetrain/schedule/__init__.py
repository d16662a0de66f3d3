"""Schedules as data: the action IR, the passes that build action lists, and the validator.

Schedules are built by name in :mod:`pipetrain.registry` (``build_schedule``, ``build_data_parallel``).
"""
from pipetrain.schedule.actions import Action, Schedule
from pipetrain.schedule.generators import evaluation, noam, warmup
from pipetrain.schedule.validate import ScheduleError, validate

__all__ = ["Action", "Schedule", "validate", "ScheduleError", "evaluation", "noam", "warmup"]
