"""The schedule IR: per-worker ordered lists of actions, with a short text form.

One action list serves the runtime (executes it with real tensors), the validator (checks it is
deadlock-free), the simulator (executes it with profiled costs) and error messages (prints it).

Text form of one action (minibatch ids are 0-based; ``.k`` names microbatch k):

=======  =================================================================
``F3``   forward of minibatch 3 (``F3.1``: its microbatch 1)
``B3``   backward of minibatch 3
``I3``   input-gradient backward of minibatch 3 (``I3.1``: its microbatch 1): what ``SB3`` sends
``W3``   weight-gradient backward of minibatch 3, after its ``I3`` on the same worker
``RF3``  receive minibatch 3's activations from the previous stage
``SF3``  send minibatch 3's activations to the next stage
``RB3``  receive minibatch 3's gradients from the next stage
``SB3``  send minibatch 3's gradients to the previous stage
``A3``   start the gradient sync of minibatch 3: hand its gradient to the strategy's synchronizer
``S3``   wait for the gradient sync of minibatch 3 (after it, the agreed gradient is on the weights)
``U3``   optimizer step, the last minibatch it includes being 3
=======  =================================================================

Where a worker holds several stages (interleaved schedules, :attr:`Schedule.looped`), an action names
its stage with ``s``: ``F3.1s2`` is stage 2's forward of minibatch 3's microbatch 1; an update without
one (``U3``) steps every stage the worker holds.

A schedule is built in three passes (see :mod:`pipetrain.schedule.generators`): the compute order
(``F``/``B`` per worker, or ``F``/``I``/``W`` where the backward is split), the point-to-point pass
(``RF``/``SF``/``RB``/``SB``), then a sync pass owned by the strategy (``A``/``S``/``U``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipetrain.layout import Layout

FORWARD, BACKWARD = "F", "B"
INPUT_GRAD, WEIGHT_GRAD = "I", "W"  # a backward split in two (zero-bubble)
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "RF", "SF", "RB", "SB"
START_SYNC, SYNC, UPDATE = "A", "S", "U"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD, START_SYNC, SYNC,
         UPDATE)
SENDS = {SEND_ACT: RECV_ACT, SEND_GRAD: RECV_GRAD}

_TEXT = re.compile(r"^(RF|SF|RB|SB|F|B|I|W|A|S|U)(\d+)(?:\.(\d+))?(?:s(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one worker: ``kind`` of minibatch ``mb`` (microbatch ``micro`` when split), of
    ``stage`` where the worker holds several (None: its only stage, or every stage for an update)."""

    kind: str
    mb: int
    micro: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + ("" if self.micro is None else f".{self.micro}") + \
            ("" if self.stage is None else f"s{self.stage}")

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of ``str(action)``: ``Action.parse("F3.1s2") == Action("F", 3, 1, 2)``."""
        m = _TEXT.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. F3, B3.1, RF2, U4, F3.1s2")
        kind, mb, micro, stage = m.groups()
        return Action(kind, int(mb), None if micro is None else int(micro), None if stage is None else int(stage))

    def counterpart(self) -> "Action":
        """The action a send or receive pairs with on its peer: ``SF3s1`` with ``RF3s2``, ``RB3s1`` with ``SB3s2``."""
        kind = {SEND_ACT: RECV_ACT, RECV_ACT: SEND_ACT, SEND_GRAD: RECV_GRAD, RECV_GRAD: SEND_GRAD}[self.kind]
        step = 1 if self.kind in (SEND_ACT, RECV_GRAD) else -1
        return Action(kind, self.mb, self.micro, None if self.stage is None else self.stage + step)

    def local(self) -> "Action":
        """This action as its stage's own worker names it (without the stage)."""
        return Action(self.kind, self.mb, self.micro)


@dataclass(frozen=True)
class Schedule:
    """What every worker does, in order.

    Attributes:
        name: the schedule generator that made it (``pipedream``, ``gpipe``, ...).
        replicas: workers per stage; worker ranks are numbered stage by stage.
        actions: ``actions[w]`` is worker ``w``'s ordered action list.
        microbatches: microbatches per minibatch (1 when minibatches are not split).
        noam: minibatches the input stage admits before its first backward.
        sharded: data parallelism: every worker of the (single) stage runs every minibatch on its
            1/r share of the samples, instead of replica ``mb mod r`` running the whole minibatch.
        stashes: a stage keeps a weight version per minibatch in flight (weight stashing, PipeDream
            §3.4): what the simulator prices the copy of a new version for.
        looped: None: each worker holds one stage (a replica of it); W: ``W`` workers hold the stages
            round robin, stage s on worker s mod W (interleaved schedules), and actions name their stage.
        double_buffered: PipeDream-2BW: round q of a worker's minibatches (q = mb // r) runs at its
            stage's weights after max(0, q-1) updates, so a stage holds two versions, the output stage
            too.
        layout: the ranks of each stage (:class:`pipetrain.layout.Layout`); with ``looped``, of the
            stages as if each had a worker of its own.
    """

    name: str
    replicas: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    microbatches: int = 1
    noam: int = 1
    sharded: bool = False
    stashes: bool = False
    looped: int | None = None
    double_buffered: bool = False
    layout: Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout(self.replicas, sharded=self.sharded))
        if self.looped is not None and (self.looped < 1 or any(r != 1 for r in self.replicas)):
            raise ValueError(f"looped={self.looped}: stages placed round robin need one replica each and a "
                             "worker count of at least 1")
        if len(self.actions) != self.num_workers:
            raise ValueError(f"{len(self.actions)} action lists for {self.num_workers} workers")

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_workers(self) -> int:
        return self.layout.world if self.looped is None else self.looped

    def stage_of(self, worker: int) -> int:
        """The stage of ``worker``, which holds one (see :meth:`stages_of` for a looped schedule)."""
        if self.looped is not None:
            raise ValueError(f"worker {worker} holds stages {list(self.stages_of(worker))}; ask stages_of")
        return self.layout.stage_of(worker)

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """The stages ``worker`` holds, in order."""
        if self.looped is None:
            return (self.layout.stage_of(worker),)
        return tuple(range(worker, self.num_stages, self.looped))

    def stage_at(self, worker: int, action: Action) -> int:
        """The stage ``action`` of ``worker`` belongs to (a stageless update: the worker's first)."""
        return self.stages_of(worker)[0] if action.stage is None else action.stage

    def first_worker(self, stage: int) -> int:
        return self.layout.first_rank(stage) if self.looped is None else stage % self.looped

    def worker_for(self, stage: int, mb: int) -> int:
        return self.layout.worker_for(stage, mb) if self.looped is None else stage % self.looped

    def peer(self, worker: int, action: Action) -> int | None:
        """The worker on the other end of a send or receive action, else None."""
        stage = self.stage_at(worker, action)
        if action.kind in (RECV_ACT, SEND_GRAD):
            return self.worker_for(stage - 1, action.mb)
        if action.kind in (SEND_ACT, RECV_GRAD):
            return self.worker_for(stage + 1, action.mb)
        return None

    def to_text(self) -> str:
        """One line per worker, e.g. ``w0: F0 SF0 F1 SF1 RB0 B0 U0 ...``; round-trips with from_text."""
        head = f"# {self.name} replicas={','.join(map(str, self.replicas))} " \
               f"microbatches={self.microbatches} noam={self.noam} sharded={int(self.sharded)} " \
               f"stashes={int(self.stashes)}" + ("" if self.looped is None else f" looped={self.looped}") \
               + (" double_buffered=1" if self.double_buffered else "")
        rows = [f"w{w}: " + " ".join(map(str, acts)) for w, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])

    @staticmethod
    def from_text(text: str) -> "Schedule":
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        head = dict(kv.split("=") for kv in lines[0].split()[2:])
        name = lines[0].split()[1]
        actions = tuple(tuple(Action.parse(a) for a in ln.split(":", 1)[1].split()) for ln in lines[1:])
        return Schedule(name, tuple(int(r) for r in head["replicas"].split(",")), actions,
                        int(head["microbatches"]), int(head["noam"]), bool(int(head.get("sharded", "0"))),
                        bool(int(head.get("stashes", "0"))),
                        looped=int(head["looped"]) if "looped" in head else None,
                        double_buffered=bool(int(head.get("double_buffered", "0"))))
