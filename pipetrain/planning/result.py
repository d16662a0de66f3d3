"""A plan as plain data: stages, replicas, NOAM and the predicted cost; JSON in and out.

JSON form (``version`` 1)::

    {"format": "pipetrain-plan", "version": 1, "config": "7-1",
     "stages": [{"first_layer": 0, "last_layer": 23, "replicas": 7, "time_s": 0.09, "boundary_s": 0.08}, ...],
     "noam": 2, "stage_time_s": 0.05, "speedup_vs_one": 7.0, "speedup_vs_dp": 3.0,
     "options": {"workers": 8, "bandwidth": 1.25e9, ...}, "samples_per_s": 1200.0, "bound": false}
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipetrain.errors import one_line
from pipetrain.jsonfile import check_header, parse_json, read_text
from pipetrain.profiling import Profile

FORMAT, VERSION = "pipetrain-plan", 1


@dataclass(frozen=True)
class StagePlan:
    """Layers ``first_layer..last_layer`` (0-based, inclusive) on ``replicas`` workers.

    ``time_s`` is the stage's predicted seconds per minibatch, T(i -> j, m) of PipeDream §3.2;
    ``boundary_s`` is 2 C_j, the seconds to send the cut after its last layer and get its gradient
    back (0 for the last stage).
    """

    first_layer: int
    last_layer: int
    replicas: int
    time_s: float = 0.0
    boundary_s: float = 0.0


@dataclass
class Plan:
    """What the partitioner decided and what it predicts.

    Attributes:
        stages: in pipeline order; together they cover every layer once.
        noam: minibatches the input stage admits to fill the pipeline (PipeDream §3.2).
        stage_time_s: predicted seconds per minibatch of the slowest stage (the pipeline's period).
        speedup_vs_one: one worker's seconds per minibatch over ``stage_time_s``.
        speedup_vs_dp: data parallelism's (one stage on all requested workers) over ``stage_time_s``.
        options: the inputs the plan was made from (workers, bandwidths, flags), for the record.
        samples_per_s: the plan run by ``pipedream`` in the simulator at the profile's batch size
            (:func:`pipetrain.predict.pipeline.price_plan`), the one figure ``plan``, ``simulate`` and
            ``train --plan`` show for it; 0 where it was not priced.
        bound: the price counts compute and link bandwidth only, since the profile holds no run set-up
            (no measured per-message or per-action costs): an upper bound, not a prediction.
        alternatives: the partitioner's best plans for fewer workers (``plan(..., also=...)``), which
            :func:`pipetrain.predict.pipeline.best_plan` simulates beside this one; not saved.
    """

    stages: list[StagePlan]
    noam: int
    stage_time_s: float
    speedup_vs_one: float
    speedup_vs_dp: float
    options: dict[str, Any] = field(default_factory=dict)
    samples_per_s: float = 0.0
    bound: bool = False
    alternatives: list[Plan] = field(default_factory=list, repr=False, compare=False)

    @property
    def config(self) -> str:
        """The paper's notation: replicas per stage joined by dashes, e.g. ``7-1``."""
        return "-".join(str(s.replicas) for s in self.stages)

    @property
    def boundaries(self) -> list[int]:
        """The first layer of each stage (what ``pipetrain.train(stages=...)`` takes)."""
        return [s.first_layer for s in self.stages]

    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last_layer + 1

    @property
    def workers(self) -> int:
        return sum(self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "config": self.config,
                "stages": [asdict(s) for s in self.stages], "noam": self.noam,
                "stage_time_s": self.stage_time_s, "speedup_vs_one": self.speedup_vs_one,
                "speedup_vs_dp": self.speedup_vs_dp, "options": self.options, "samples_per_s": self.samples_per_s,
                "bound": self.bound}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def from_dict(data: Any, source: str = "plan") -> "Plan":
        """Raises ValueError (one line naming ``source``) unless ``data`` is a valid plan of this version."""
        check_header(data, FORMAT, VERSION, source, "`pipetrain plan`", ValueError)
        try:
            stages = [StagePlan(int(s["first_layer"]), int(s["last_layer"]), int(s["replicas"]),
                                float(s.get("time_s", 0.0)), float(s.get("boundary_s", 0.0)))
                      for s in data["stages"]]
            plan = Plan(stages, int(data["noam"]), float(data["stage_time_s"]), float(data["speedup_vs_one"]),
                        float(data["speedup_vs_dp"]), dict(data.get("options", {})),
                        float(data.get("samples_per_s", 0.0)), bool(data.get("bound", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: malformed plan ({one_line(e)}); "
                             "regenerate it with `pipetrain plan`") from None
        _check_stages(plan, source)
        return plan

    @staticmethod
    def load(path: str | os.PathLike) -> "Plan":
        """Read a plan written by :meth:`save`; errors are one line naming the file."""
        make = f"`pipetrain plan PROFILE --workers N -o {path}`"
        return Plan.from_dict(parse_json(read_text(path, "plan", make, ValueError), str(path), make, ValueError),
                              str(path))


def _check_stages(plan: Plan, source: str) -> None:
    if not plan.stages:
        raise ValueError(f"{source}: plan has no stages; regenerate it with `pipetrain plan`")
    expect = 0
    for s in plan.stages:
        if s.first_layer != expect or s.last_layer < s.first_layer or s.replicas < 1:
            raise ValueError(f"{source}: stages must cover layers 0, 1, ... in order with replicas >= 1 "
                             f"(bad stage {asdict(s)}); regenerate it with `pipetrain plan`")
        expect = s.last_layer + 1


def check_fits(plan_or_profile: Plan | Profile, num_layers: int, source: str = "plan") -> None:
    """Raise ValueError unless a plan or profile was made for a model of ``num_layers`` layers.

    Args:
        plan_or_profile: what was loaded.
        num_layers: ``len(LayeredModel(model))`` of the model about to run.
        source: the file it came from, for the message.

    Raises:
        ValueError: one line naming ``source``, both layer counts and the fix.
    """
    have = plan_or_profile.num_layers if isinstance(plan_or_profile, Plan) else len(plan_or_profile)
    if have != num_layers:
        raise ValueError(f"{source}: made for a model of {have} layers but this model has {num_layers}; "
                         "re-run `pipetrain profile` on this model, then `pipetrain plan`")
