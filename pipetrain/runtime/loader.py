"""Where a worker's minibatches come from: built inline by its compute thread, or ahead of time by
background loader processes.

[Note: item seeds] Every item is fetched with torch's CPU generator and Python's ``random`` seeded
from (the job's seed, the epoch, whether it is evaluation, the item's index), and the worker's own
random state is put back afterwards. So a dataset's random transform draws the same numbers for an
item whichever process fetches it (the worker itself, or any of its loaders), and fetching never
moves the stream that dropout and the like draw from: ``loader_workers=0`` and ``loader_workers=N``
train bitwise alike. A dataset with ``__getitems__`` is fetched in one call per minibatch, seeded
from its first item.
"""
from __future__ import annotations

import contextlib
import random
import signal
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch
import torch.multiprocessing as tmp
from torch.utils.data import TensorDataset

from pipetrain.batches import DEFAULT_TARGET_KEY, TargetKey, collate_parts, map_tensors
from pipetrain.errors import one_line
from pipetrain.runtime.launch import LOADER_DIED, die_with_parent


@dataclass(frozen=True)
class Recipe:
    """How a job builds minibatches, the same for every minibatch: what a loader inherits when it starts."""

    dataset: Any
    eval_dataset: Any = None
    seed: int = 0
    target_key: TargetKey = DEFAULT_TARGET_KEY
    collate_fn: Callable[[list[Any]], Any] | None = None


@dataclass(frozen=True)
class Task:
    """One minibatch to build (picklable): ``items`` of the training (or evaluation) dataset, the
    ``parts`` the worker needs (0: inputs, 1: targets), seeded for ``epoch``."""

    mb: int
    items: tuple[int, ...]
    parts: tuple[int, ...]
    epoch: int
    eval: bool = False


class LoadError(RuntimeError):
    """Building a minibatch failed (the dataset raised, or a loader died or hung); the worker names itself."""


class ItemFailed(Exception):
    """The dataset raised on ``item`` (None: in a ``__getitems__`` call of several)."""

    def __init__(self, item: int | None, error: str) -> None:
        super().__init__(item, error)
        self.item, self.error = item, error


def build(recipe: Recipe, task: Task) -> list[Any]:
    """The parts ``task`` asks for, each item fetched with its own seed (see [Note: item seeds])."""
    dataset = recipe.eval_dataset if task.eval else recipe.dataset
    if type(dataset) is TensorDataset:  # rows are indexed: no user code, no random draws
        return collate_parts(dataset, task.items, task.parts, recipe.target_key, recipe.collate_fn)
    with _own_rng():
        return collate_parts(_Seeded(dataset, recipe.seed, task.epoch, task.eval), task.items, task.parts,
                             recipe.target_key, recipe.collate_fn)


def item_seed(seed: int, epoch: int, evaluating: bool, item: int) -> int:
    """The seed item ``item`` is fetched with in ``epoch`` of a job seeded ``seed``."""
    return (((seed * 1_000_003 + epoch) * 2 + evaluating) * (1 << 32) + item) % (1 << 63)


class _Seeded:
    """``dataset`` whose every fetch is seeded by :func:`item_seed`, and whose errors name the item."""

    def __init__(self, dataset: Any, seed: int, epoch: int, evaluating: bool) -> None:
        self._dataset, self._key = dataset, (seed, epoch, evaluating)
        if getattr(dataset, "__getitems__", None) is not None:
            self.__getitems__ = self._getitems

    def __getitem__(self, j: int) -> Any:
        _seed(item_seed(*self._key, j))
        try:
            return self._dataset[j]
        except Exception as e:  # the user's dataset may raise anything
            raise ItemFailed(j, one_line(e)) from e

    def _getitems(self, items: list[int]) -> Any:
        _seed(item_seed(*self._key, items[0]))
        try:
            return self._dataset.__getitems__(items)
        except Exception as e:  # the user's dataset may raise anything
            raise ItemFailed(None, one_line(e)) from e


def _seed(s: int) -> None:
    torch.default_generator.manual_seed(s)
    random.seed(s)


@contextlib.contextmanager
def _own_rng() -> Iterator[None]:
    """Put torch's CPU generator and Python's ``random`` back as they were."""
    state, py = torch.get_rng_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(state)
        random.setstate(py)


def _where(item: int | None, items: Sequence[int]) -> str:
    return f"item {item}" if item is not None else f"items {items[0]}..{items[-1]}"


class Source(Protocol):
    """A worker's minibatches: :meth:`begin` names those it will ask for, in order; :meth:`get` gives
    one's parts."""

    def begin(self, tasks: list[Task]) -> None: ...

    def get(self, mb: int) -> list[Any]: ...

    def close(self) -> None: ...


class Inline:
    """Builds each minibatch when it is asked for, in the worker's own thread."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._tasks: dict[int, Task] = {}

    def begin(self, tasks: list[Task]) -> None:
        self._tasks = {task.mb: task for task in tasks}

    def get(self, mb: int) -> list[Any]:
        task = self._tasks.pop(mb)
        try:
            return build(self.recipe, task)
        except ItemFailed as e:
            raise LoadError(f"the dataset failed on {_where(e.item, task.items)} of minibatch {mb}: "
                            f"{e.error}") from None

    def close(self) -> None:
        pass


class Loaders:
    """``n`` background processes that build a worker's minibatches ahead, ``prefetch`` per loader.

    Loaders are forked from the worker (the dataset is inherited, not pickled), are daemons, and are
    killed when the worker dies (Linux's parent-death signal; elsewhere they end when their pipe
    closes). Results come back through a pipe per loader as shared-memory tensors, pinned when the
    worker trains on a GPU. A loader that dies, or builds nothing for ``timeout`` seconds, fails the
    worker; a death counts as the worker's (``max_restarts`` restarts the job).
    """

    def __init__(self, recipe: Recipe, n: int, prefetch: int, timeout: float, pin: bool = False) -> None:
        ctx = tmp.get_context("fork")
        self.timeout, self.pin, self.limit = timeout, pin, n * prefetch
        self.procs, self.conns = [], []
        for k in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(recipe, theirs), daemon=True, name=f"pipetrain-loader-{k}")
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        self._todo: deque[Task] = deque()
        self._given: dict[int, tuple[int, Task]] = {}  # mb -> the loader building it, the task
        self._ready: dict[int, list[Any]] = {}

    def begin(self, tasks: list[Task]) -> None:
        assert not self._given and not self._ready, "a plan began before the previous one was used up"
        self._todo = deque(tasks)
        self._fill()

    def _fill(self) -> None:
        while self._todo and len(self._given) + len(self._ready) < self.limit:
            task = self._todo.popleft()
            load = [sum(1 for k, _ in self._given.values() if k == j) for j in range(len(self.procs))]
            k = load.index(min(load))
            self.conns[k].send(task)
            self._given[task.mb] = (k, task)

    def get(self, mb: int) -> list[Any]:
        while mb not in self._ready:
            k, _ = self._given[mb]
            conn, proc = self.conns[k], self.procs[k]
            if not wait([conn, proc.sentinel], self.timeout):
                raise LoadError(f"loader {k} built nothing for {self.timeout:g}s while building minibatch {mb} "
                                "(a dataset item that never returns?)")
            try:
                if not conn.poll():  # only the sentinel: the process ended
                    raise EOFError
                got, values, error = conn.recv()
            except (EOFError, OSError):
                proc.join(1)
                code = proc.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
                raise LoadError(f"{LOADER_DIED}: loader {k} ({how}) while building minibatch {mb}") from None
            _, done = self._given.pop(got)
            if error is not None:
                raise LoadError(f"loader {k} failed on {_where(error[0], done.items)} of minibatch {got}: {error[1]}")
            self._ready[got] = map_tensors(values, torch.Tensor.pin_memory) if self.pin else values
        values = self._ready.pop(mb)
        self._fill()
        return values

    def close(self) -> None:
        """Stop the loaders (each ends after its current minibatch; one that does not is killed)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(1)
            if p.exitcode is None:
                p.kill()
                p.join(1)


def _serve(recipe: Recipe, conn: Connection) -> None:
    """A loader: build each task the worker sends, send back (mb, parts, None) or (mb, None, (item, error))."""
    die_with_parent()
    torch.set_num_threads(1)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the worker is gone
            return
        if task is None:
            return
        try:
            conn.send((task.mb, build(recipe, task), None))
        except ItemFailed as e:
            conn.send((task.mb, None, (e.item, e.error)))
        except Exception as e:  # collating the user's items may raise anything
            conn.send((task.mb, None, (None, one_line(e))))
