"""Small models and failure-injecting layers for the multi-process tests (module level so they pickle)."""
import os
import signal
import time

import torch
from torch import nn

SIZES = [4, 6, 6, 6, 3]  # widths of the 4-stage exactness MLP


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear+Tanh x3, then Linear: 7 layers; stages=[0, 2, 4, 6] puts one Linear on each stage."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


class Residual(nn.Module):
    """A branchy fx-traceable model: the cut inside the block carries two tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(4, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        y = self.b(torch.tanh(self.a(h)))
        return self.out(y + h)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return self.lin(x)
        return -self.lin(x)


class FaultAt(nn.Module):
    """Identity that fails on its ``n``-th forward: ``die`` ends the process as a crash would,
    ``hang`` stops answering; only on worker ``rank`` when given (every worker of data parallelism
    holds this layer)."""

    def __init__(self, n: int, how: str, rank: int | None = None) -> None:
        super().__init__()
        self.n, self.how, self.calls, self.rank = n, how, 0, rank

    def forward(self, x):
        if self.rank is not None and os.environ.get("RANK") != str(self.rank):
            return x
        self.calls += 1
        if self.calls == self.n and self.how == "die":
            os._exit(3)
        if self.calls == self.n:
            time.sleep(3600)
        return x


def nan_loss(output, target):
    """A loss that has gone bad."""
    return torch.nn.functional.mse_loss(output, target) * float("nan")


class KillOnce(nn.Module):
    """Identity that sends ``sig`` (default SIGKILL; SIGSTOP stops it) to its own process on worker
    ``rank``, once per ``marker`` file: at its ``at``-th training forward, or (``when="save"``) at the
    first checkpoint save after ``at`` forwards (the state being gathered, while other workers write
    theirs)."""

    def __init__(self, rank: int, at: int, marker: str, when: str = "forward", sig: int = signal.SIGKILL) -> None:
        super().__init__()
        self.rank, self.at, self.marker, self.when, self.sig, self.calls = rank, at, marker, when, sig, 0

    def _kill(self) -> None:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), self.sig)

    def forward(self, x):
        if self.training and torch.is_grad_enabled() and os.environ.get("RANK") == str(self.rank):
            self.calls += 1
            if self.when == "forward" and self.calls == self.at:
                self._kill()
        return x

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.when == "save" and self.calls >= self.at and os.environ.get("RANK") == str(self.rank):
            self._kill()
        super()._save_to_state_dict(destination, prefix, keep_vars)


class BusyOn(nn.Module):
    """Identity that computes in Python (holding the GIL) for ``seconds`` per forward on worker ``rank``:
    a slow worker, not a dead one."""

    def __init__(self, rank: int, seconds: float) -> None:
        super().__init__()
        self.rank, self.seconds = rank, seconds

    def forward(self, x):
        if os.environ.get("RANK") == str(self.rank):
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                sum(range(1000))
        return x


class Spell:
    """A set-up probe's kernel (``pipetrain.setup.measure_setup``): sleeps ``base`` seconds a call, ``slow`` times
    that on every rank but 0 for the first ``spell`` seconds after the process's first call: a machine
    that takes cores from a job for a while."""

    def __init__(self, base: float, slow: float, spell: float) -> None:
        self.base, self.slow, self.spell = base, slow, spell
        self.start: float | None = None

    def __call__(self) -> None:
        import torch.distributed as dist

        now = time.monotonic()
        self.start = now if self.start is None else self.start
        late = dist.get_rank() > 0 and now - self.start < self.spell
        time.sleep(self.base * (self.slow if late else 1.0))
