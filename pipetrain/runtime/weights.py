"""Which weights a minibatch's forward and backward use (PipeDream §3.4).

A stage's *live* parameters are the ones the optimizer updates. A policy hands the forward of each
minibatch a dict of weights to run with (swapped in by :func:`pipetrain.weightswap.call_with`) and,
after its backward, puts the gradient on the live parameters' ``.grad`` for the optimizer.

* ``Live`` (flush schedules): nothing is in flight across an update, so the live weights are used.
* ``Stashing`` (``pipedream``): the forward uses the newest version; the version is stashed for that
  minibatch's backward. Minibatches admitted between two updates share one stashed copy, so a stage
  holds at most one version per minibatch in flight, and usually fewer. A worker that never holds
  more than one minibatch (the output stage) updates only between a backward and the next forward,
  so it needs no copy and runs ``Live`` (see ``runtime.job``).
* ``VerticalSync``: every stage runs minibatch t with the version the input stage used for t, carried
  in the message header; a stage keeps the versions that later minibatches may still ask for.
* ``DoubleBuffered`` (``2bw``, PipeDream-2BW): minibatch k of an epoch (0-based) runs every microbatch,
  at every stage, with the version after max(0, k-1) of the epoch's updates (a replicated stage counts
  rounds of its replicas' minibatches); a stage keeps its newest version and the one before it, never
  more.
* ``Naive`` (the ablation): forward with the newest weights, backward with the weights current at
  backward time (the stage's forward is recomputed on the stashed input with those weights).

Versions are counted in minibatches applied: a straight stage's version is its update count.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from pipetrain.batches import tensor_bytes

Weights = dict[str, torch.Tensor]


class Live:
    """The live parameters themselves; gradients accumulate on them directly."""

    recompute = False

    def __init__(self, stage: nn.Module, tied: Collection[str] = ()) -> None:
        # a tied parameter's versions are kept by runtime.tied instead
        self.params: Weights = {k: p for k, p in stage.named_parameters() if k not in tied}
        self.version = 0
        self.peak_versions = 1  # the most distinct versions held at once, the live weights' included

    def begin(self, replicas: int) -> None:
        """An epoch starts on a stage of ``replicas`` workers; nothing is in flight."""

    def _hold(self, versions: Iterable[int]) -> int:
        """Count the live version and ``versions`` as held now; how many that is."""
        held = len({self.version, *versions})
        self.peak_versions = max(self.peak_versions, held)
        return held

    def forward_weights(self, mb: int, tag: int | None) -> Weights:
        """Weights for the forward of ``mb``; ``tag`` is the input stage's version (vertical sync)."""
        return self.params

    def version_of(self, mb: int, tag: int | None) -> int:
        """The version the forward of ``mb`` ran at, as its messages carry it and tied parameters follow
        it: the input stage's (``tag``) where it came with one, else this stage's."""
        return self.version if tag is None else tag

    def backward_weights(self, mb: int) -> Weights:
        return self.params

    def after_backward(self, mb: int) -> None:
        """Move ``mb``'s gradient onto the live parameters and drop what it held."""

    def updated(self, minibatches: int) -> None:
        """The optimizer just applied ``minibatches`` minibatches' gradients."""
        self.version += minibatches

    def stashed_bytes(self) -> int:
        """Bytes of the weight versions held besides the live weights (none here)."""
        return 0


class Stashing(Live):
    """Weight stashing: the backward of a minibatch uses the weights its forward used."""

    recycle = True  # reuse the copies no minibatch holds any more (a fresh allocation costs page faults)

    def __init__(self, stage: nn.Module, tied: Collection[str] = ()) -> None:
        super().__init__(stage, tied)
        self._stash: dict[int, Weights] = {}
        self._newest: tuple[int, Weights] | None = None  # (version, copy) shared while unchanged
        self._free: list[Weights] = []
        self._at: dict[int, int] = {}  # mb in flight -> the version its forward ran at
        self._copy_bytes = tensor_bytes(self.params.values())  # every copy is of the live weights' shapes

    def _copy(self) -> Weights:
        if self._free:
            copy = self._free.pop()
            if self.params:  # a stage whose parameters are all tied has none of its own
                with torch.no_grad():
                    torch._foreach_copy_([copy[k] for k in self.params], list(self.params.values()))
            return copy
        return {k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in self.params.items()}

    def forward_weights(self, mb: int, tag: int | None) -> Weights:
        if self._newest is None or self._newest[0] != self.version:
            self._newest = (self.version, self._copy())
        self._stash[mb], self._at[mb] = self._newest[1], self.version
        self._hold(self._at.values())
        return self._stash[mb]

    def backward_weights(self, mb: int) -> Weights:
        return self._stash[mb]

    def stashed_bytes(self) -> int:
        return len({id(w) for w in self._held()}) * self._copy_bytes

    def _held(self) -> list[Weights]:
        """The copies in use (some more than once)."""
        return [*self._stash.values(), *([self._newest[1]] if self._newest else [])]

    def after_backward(self, mb: int) -> None:
        used = self._stash.pop(mb)
        del self._at[mb]
        for k, p in self.params.items():
            g = used[k].grad
            if g is not None:  # moved, not copied: the stash lets go of it just below
                p.grad = g if p.grad is None else p.grad.add_(g)
            used[k].grad = None
        self._release(used)

    def _release(self, copy: Weights) -> None:
        """Keep ``copy`` for reuse if nothing holds it any more."""
        if self.recycle and not any(w is copy for w in self._held()):
            self._free.append(copy)


class _Versioned(Stashing):
    """Stashing that also keeps a table of weight versions (version -> weights), held like the stashes."""

    def __init__(self, stage: nn.Module, tied: Collection[str] = ()) -> None:
        super().__init__(stage, tied)
        self._versions: dict[int, Weights] = {}

    def _held(self) -> list[Weights]:
        return [*super()._held(), *self._versions.values()]


class VerticalSync(_Versioned):
    """Run minibatch t with the version the input stage used for t, at every stage."""

    recycle = False  # versions leave the table unreleased; let the garbage collector free them

    def updated(self, minibatches: int) -> None:
        super().updated(minibatches)
        self._versions[self.version] = self._copy()  # filled from the first forward on

    def forward_weights(self, mb: int, tag: int | None) -> Weights:
        if not self._versions:  # no update can precede a stage's first forward
            self._versions[self.version] = self._copy()
        want = self.version if tag is None else tag
        have = max(v for v in self._versions if v <= want)
        # later minibatches carry tags >= want: older versions are needed only by stashes
        for v in [v for v in self._versions if v < have]:
            del self._versions[v]
        self._stash[mb], self._at[mb] = self._versions[have], have
        self._hold(self._at.values())
        return self._stash[mb]


class DoubleBuffered(_Versioned):
    """PipeDream-2BW: minibatch k of an epoch runs at the version after max(0, k-1) of its updates;
    on a stage of r replicas, round q = k // r of a replica's minibatches at the version after
    max(0, q-1) of them (r minibatches each).

    Under 1F1B over microbatches without a flush, m >= n microbatches, a stage other than the output
    stage has made k-1 updates when minibatch k's first microbatch arrives and makes the k-th during
    minibatch k's microbatches; the output stage has made k. So every update copies the new version,
    and the version before it is kept for the minibatches that still run at it.
    """

    def __init__(self, stage: nn.Module, tied: Collection[str] = ()) -> None:
        super().__init__(stage, tied)  # its version table: the newest version and the one before it
        self._base, self._replicas = 0, 1  # the version the epoch started at, the stage's workers

    def begin(self, replicas: int) -> None:
        self._base, self._replicas = self.version, replicas

    def forward_weights(self, mb: int, tag: int | None) -> Weights:
        if mb not in self._stash:  # its first microbatch: every later one runs at the same version
            r = self._replicas
            want = self._base + r * max(0, mb // r - 1)
            if want == self.version and want not in self._versions:
                self._versions[want] = self._copy()
            if want not in self._versions:
                raise AssertionError(f"minibatch {mb} needs weight version {want}; this stage holds "
                                     f"{sorted(self._versions)} (the schedule breaks the 2bw order)")
            self._stash[mb], self._at[mb] = self._versions[want], want
            self._check()
        return self._stash[mb]

    def version_of(self, mb: int, tag: int | None) -> int:
        return self._at[mb]

    def updated(self, minibatches: int) -> None:
        super().updated(minibatches)
        dropped = [w for v, w in self._versions.items() if v != self.version - minibatches]
        self._versions = {v: w for v, w in self._versions.items() if v == self.version - minibatches}
        for copy in dropped:  # its buffers take the new version: no fresh allocation per update
            self._release(copy)
        self._versions[self.version] = self._copy()
        self._check()

    def _check(self) -> None:
        held = self._hold([*self._versions, *self._at.values()])
        assert held <= 2, f"a double-buffered stage holds {held} weight versions"


class Naive(Live):
    """No stashing: the backward recomputes the forward with whatever weights are current then."""

    recompute = True


POLICIES = {"live": Live, "stash": Stashing, "vertical": VerticalSync, "double": DoubleBuffered, "naive": Naive}
