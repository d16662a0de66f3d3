"""Schedules as data: the action IR, generators for each schedule, and the validator."""
from pipetrain.schedule.actions import Action, Schedule
from pipetrain.schedule.generators import FLUSH_SCHEDULES, SCHEDULES, build_schedule, noam, warmup
from pipetrain.schedule.validate import ScheduleError, validate

__all__ = ["Action", "Schedule", "build_schedule", "validate", "ScheduleError", "noam", "warmup",
           "SCHEDULES", "FLUSH_SCHEDULES"]
