"""Tied parameters across stages: one copy per stage that reads it, kept identical.

A parameter that layers of several stages read (a language model's input embedding and output
layer) lives on each of those stages. The first of them *owns* it: only its optimizer updates it.

* Every forward of minibatch t reads the tied parameter at the version the input stage used for t
  (the version every message carries, as vertical sync runs by): at a flush schedule that is every
  update so far; in ``pipedream`` it is max(0, t-n) of n stages, however deep the stage; in ``2bw``
  max(0, t-2).
* After the last backward of a minibatch each copy's gradient is taken off the version it used.
  At the update of that minibatch the other stages send theirs to the owner, which sums them into
  its own (before clipping, so clipping counts the parameter once), steps, and sends the new value
  to the others in one direct message each.
* A stage that borrows the parameter receives each new value when a forward first asks for it, and
  every remaining one at the end of the epoch, when its live copy takes the newest value: the
  checkpoints, the evaluation and the returned model see identical copies.

Sends and receives go on the worker's transport, on channels of their own, between the owner and
each other stage that reads the parameter (edges that :func:`edges` adds to the job's).

Why no deadlock: the owner is the earliest of the stages that read the parameter, so it runs each
minibatch's forward before them and its backward after them. A borrower sends minibatch k's gradient
at its update k, which never waits on the owner; the owner waits for it at its update k, after its
own backward of k. A borrower waits for version v at a forward whose input-stage version is v, and
the owner sent v at its update v, which precedes its own forward of that minibatch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipetrain.config import Tie
from pipetrain.layout import Layout
from pipetrain.batches import tensor_bytes
from pipetrain.runtime.transport import Channel, Message

GRADIENTS, VALUES = 1, 2
"""Transport channels: a borrower's gradients to the owner, the owner's new values to a borrower."""


def edges(ties: Sequence[Tie], layout: Layout) -> list[tuple[int, int]]:
    """The directed worker pairs the tied parameters' messages use (owner to borrower and back)."""
    out = set()
    for tie in ties:
        owner = layout.first_rank(tie.stages[0])
        for s in tie.stages[1:]:
            out |= {(owner, layout.first_rank(s)), (layout.first_rank(s), owner)}
    return sorted(out)


class TiedCopies:
    """One worker's copies of the tied parameters it reads, and their exchange with the other stages.

    Args:
        stage: this worker's stage module.
        ties: every tie of the job (with every name of each tied parameter: the stage holds it under one
            of them).
        layout: the job's workers.
        rank: this worker's rank.
        channel: the worker's transport.

    :meth:`start` gives the copies their first values.
    """

    def __init__(self, stage: nn.Module, ties: Sequence[Tie], layout: Layout, rank: int, channel: Channel) -> None:
        by_name = dict(stage.named_parameters(remove_duplicate=False))
        local: dict[int, str] = {}  # a parameter's first name in the stage, as named_parameters() gives it
        for n, p in by_name.items():
            local.setdefault(id(p), n)
        self.channel = channel
        self.live: dict[str, nn.Parameter] = {}  # local name -> this stage's parameter
        self.owned: list[str] = []
        self.borrowers: dict[int, list[str]] = {}  # as owner: borrower rank -> the local names it gets
        self.lenders: dict[int, list[str]] = {}  # as borrower: owner rank -> the local names it lends
        me = layout.stage_of(rank)
        for tie in ties:
            if me not in tie.stages:
                continue
            held = by_name[next(n for n in tie.names if n in by_name)]
            mine = local[id(held)]
            self.live[mine] = held
            if tie.stages[0] == me:
                self.owned.append(mine)
                for s in tie.stages[1:]:
                    self.borrowers.setdefault(layout.first_rank(s), []).append(mine)
            else:
                self.lenders.setdefault(layout.first_rank(tie.stages[0]), []).append(mine)
        self._versions: dict[str, dict[int, torch.Tensor]] = {}
        self._lent = 0  # the newest version received from the owners
        self._used: dict[int, dict[str, int]] = {}  # minibatch in flight -> the version of each it read
        self._grads: list[dict[str, torch.Tensor]] = []  # the gradients taken since the last update
        self._updates = self._values_sent = self._values_received = 0  # messages' sequence numbers

    def start(self, version: int) -> None:
        """Begin at weight ``version`` (0, or where a resumed job goes on) with the stage's values."""
        # per local name: version -> its value, a leaf the forwards that read that version share
        self._versions = {n: {version: _leaf(p)} for n, p in self.live.items()}
        self._lent = version

    @property
    def borrowed(self) -> set[str]:
        """The local names of the tied parameters another stage owns (its optimizer leaves them out)."""
        return set(self.live) - set(self.owned)

    @property
    def names(self) -> set[str]:
        """The stage's local names of its tied parameters (what its weight policy leaves out)."""
        return set(self.live)

    def stashed_bytes(self) -> int:
        """Bytes of the versions of the tied parameters this stage holds (its copies, the newest included)."""
        return sum(len(versions) * tensor_bytes([self.live[n]]) for n, versions in self._versions.items())

    def weights(self, mb: int, version: int) -> dict[str, torch.Tensor]:
        """The tied parameters for the forward of ``mb``, whose input stage ran at ``version``: for
        each, its newest version not after that (received first where this stage borrows it)."""
        while self.lenders and self._lent < version:
            self._receive()
        out, used = {}, {}
        for n, versions in self._versions.items():
            used[n] = max(v for v in versions if v <= version)
            out[n] = versions[used[n]]
        self._used[mb] = used
        for n, versions in self._versions.items():  # later forwards ask for the same or later versions
            keep = min(u[n] for u in self._used.values())
            for v in [v for v in versions if v < keep]:
                del versions[v]
        return out

    def take_gradient(self, mb: int) -> None:
        """After the last backward of ``mb``: move its gradient off the versions it read."""
        grads = {}
        for n, v in self._used.pop(mb).items():
            t = self._versions[n][v]
            grads[n] = torch.zeros_like(t) if t.grad is None else t.grad
            t.grad = None
        self._grads.append(grads)

    def before_update(self) -> None:
        """At an update: a borrower sends the gradients taken since the last one to each owner; the
        owner puts the sum of every copy's on its parameters' ``.grad`` (before clipping)."""
        total = {n: sum((g[n] for g in self._grads[1:]), self._grads[0][n]) for n in self.live}
        self._grads = []
        for owner, names in self.lenders.items():
            self.channel.send(owner, Message(self._updates, None, 0, [total[n] for n in names], False, GRADIENTS))
        for borrower, names in self.borrowers.items():
            got = self.channel.recv(borrower, self._updates, None, "the tied parameters' gradients", GRADIENTS)
            for n, g in zip(names, got.tensors):
                total[n] = total[n] + g
        self._updates += 1
        for n in self.owned:
            self.live[n].grad = total[n]

    def after_update(self, version: int) -> None:
        """This stage just stepped to ``version``: keep its owned parameters' new values and send them
        to the borrowers."""
        for n in self.owned:
            self._versions[n][version] = _leaf(self.live[n])
        for borrower, names in self.borrowers.items():
            self.channel.send(borrower, Message(self._values_sent, None, version,
                                                [self._versions[n][version].detach() for n in names], False, VALUES))
        self._values_sent += bool(self.borrowers)

    def _receive(self) -> None:
        """Take the next new values from every owner this stage borrows from."""
        for owner, names in self.lenders.items():
            got = self.channel.recv(owner, self._values_received, None, "the tied parameters' new values", VALUES)
            for n, t in zip(names, got.tensors):
                self._versions[n][got.version] = t.detach().requires_grad_()
            self._lent = got.version
        self._values_received += 1

    def finish(self, version: int) -> None:
        """At the end of an epoch (every stage at ``version``, nothing in flight): a borrower takes every
        value not yet received and its live copies take the newest, so every stage holds the same."""
        while self.lenders and self._lent < version:
            self._receive()
        with torch.no_grad():
            for n, versions in self._versions.items():
                newest = max(versions)
                self._versions[n] = {newest: versions[newest]}
                if n not in self.owned:
                    self.live[n].copy_(versions[newest])


def _leaf(p: torch.Tensor) -> torch.Tensor:
    return p.detach().clone().requires_grad_()
