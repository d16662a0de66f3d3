"""Which worker runs what: the one place that turns stages and replicas into ranks.

Ranks are numbered stage by stage: stage 0's replicas first, then stage 1's, and so on. A replicated
pipeline stage takes whole minibatches round robin (minibatch t on replica t mod r, PipeDream §3.3);
a data-parallel layout is one stage whose workers each take a shard of every minibatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """Stages, the workers of each, and how they split the work; checked to add up when made.

    Attributes:
        replicas: workers per stage (``(4,)`` for four data-parallel workers).
        boundaries: the first layer index of each stage, or None where the stages' layers are not
            given (data parallelism: every worker holds the whole model; a schedule's own layout).
            Checked against the model's layers by :func:`pipetrain.layers.check_boundaries`.
        sharded: data parallelism: one stage, every worker takes 1/r of every minibatch (instead of
            replica ``t mod r`` taking minibatch t whole).
    """

    replicas: tuple[int, ...]
    boundaries: tuple[int, ...] | None = None
    sharded: bool = False
    # per rank its stage, per stage its first rank: the simulator and the workers ask for every action
    _stage_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.replicas or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                        for r in self.replicas):
            raise ValueError(f"replicas {list(self.replicas)}: give a worker count of at least 1 for every stage")
        object.__setattr__(self, "_stage_of", tuple(s for s, r in enumerate(self.replicas) for _ in range(r)))
        object.__setattr__(self, "_firsts", tuple(sum(self.replicas[:s]) for s in range(len(self.replicas))))
        if self.sharded and len(self.replicas) != 1:
            raise ValueError(f"a data-parallel layout has one stage, not {len(self.replicas)}")
        if self.boundaries is None:
            return
        b = self.boundaries
        if len(b) != len(self.replicas):
            raise ValueError(f"replicas {list(self.replicas)} give a worker count for {len(self.replicas)} stages, "
                             f"but stages={list(b)} has {len(b)}; give one count per stage")

    @classmethod
    def data_parallel_on(cls, workers: int) -> Layout:
        """``workers`` workers, each holding the whole model and taking a shard of every minibatch."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r}: give the number of workers, at least 1")
        return cls((workers,), None, sharded=True)

    @classmethod
    def pipeline(cls, boundaries: tuple[int, ...] | list[int], replicas: tuple[int, ...] | list[int] | None = None
                 ) -> Layout:
        """Stages beginning at ``boundaries``, each on ``replicas`` workers (default one each)."""
        bounds = tuple(boundaries)
        return cls(tuple(replicas) if replicas is not None else (1,) * len(bounds), bounds)

    @property
    def data_parallel(self) -> bool:
        return self.sharded

    @property
    def world(self) -> int:
        """Workers in all."""
        return len(self._stage_of)

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def config(self) -> str:
        """PipeDream's notation: replicas per stage joined by dashes, e.g. ``2-1-1``."""
        return "-".join(map(str, self.replicas))

    @property
    def rounds(self) -> int:
        """Minibatches an epoch's count must be a multiple of, so every replica joins every sync."""
        return 1 if self.sharded else math.lcm(*self.replicas)

    def stage_of(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of the layout's {self.world} workers")
        return self._stage_of[rank]

    def first_rank(self, stage: int) -> int:
        return self._firsts[stage]

    def replica_of(self, rank: int) -> int:
        """Which of its stage's replicas ``rank`` is (0-based)."""
        return rank - self.first_rank(self.stage_of(rank))

    def worker_for(self, stage: int, mb: int) -> int:
        """The replica of ``stage`` that runs minibatch ``mb``: round robin, mb mod replicas (PipeDream §3.3)."""
        return self.first_rank(stage) + mb % self.replicas[stage]

    def reporter(self, rank: int) -> bool:
        """Does ``rank`` record the training history: a replica of the output stage (worker 0 of data
        parallelism, where every worker records the same steps)."""
        return rank == 0 if self.sharded else rank >= self.first_reporter

    @property
    def first_reporter(self) -> int:
        """The lowest rank that records the training history (:meth:`reporter`)."""
        return 0 if self.sharded else self.world - self.replicas[-1]

    def name(self, rank: int) -> str:
        """How messages name ``rank``: ``worker r``, ``stage s (rank r)`` or ``stage s replica i (rank r)``."""
        if self.sharded:
            return f"worker {rank}"
        s = self.stage_of(rank)
        return f"stage {s} (rank {rank})" if self.replicas[s] == 1 else \
            f"stage {s} replica {self.replica_of(rank)} (rank {rank})"

    def edges(self) -> list[tuple[int, int]]:
        """Every directed worker pair that exchanges activations or gradients."""
        out = set()
        for s in range(self.num_stages - 1):
            for mb in range(math.lcm(self.replicas[s], self.replicas[s + 1])):
                a, b = self.worker_for(s, mb), self.worker_for(s + 1, mb)
                out |= {(a, b), (b, a)}
        return sorted(out)

    def layer_range(self, stage: int, num_layers: int) -> tuple[int, int]:
        """The first and last layer (inclusive) of ``stage`` in a model of ``num_layers``."""
        if self.boundaries is None:
            return 0, num_layers - 1
        ends = [*self.boundaries[1:], num_layers]
        return self.boundaries[stage], ends[stage] - 1
