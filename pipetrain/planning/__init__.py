"""Planning: PipeDream's partitioner (profile -> plan), the plan as data, and unit parsing."""
from pipetrain.planning.partition import plan
from pipetrain.planning.result import Plan, StagePlan, check_fits
from pipetrain.planning.units import parse_bandwidth, parse_bytes

__all__ = ["plan", "Plan", "StagePlan", "check_fits", "parse_bandwidth", "parse_bytes"]
