"""Where a worker's minibatches come from: built inline by its compute thread, or ahead of time by the
worker processes of a ``torch.utils.data.DataLoader``.

[Note: item seeds] Every item is fetched with torch's CPU generator and Python's ``random`` seeded
from (the job's seed, the epoch, whether it is evaluation, the item's index), and the worker's own
random state is put back afterwards. So a dataset's random transform draws the same numbers for an
item whichever process fetches it (the worker itself, or any of its loaders), and fetching never
moves the stream that dropout and the like draw from: ``loader_workers=0`` and ``loader_workers=N``
train bitwise alike. A dataset with ``__getitems__`` is fetched in one call per minibatch, seeded
from its first item. A stream (:mod:`pipetrain.streams`) is read from its start each pass, every
item drawn with the seed of its position, so every process reading it sees the same items.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data._utils import signal_handling
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset, get_worker_info

from pipetrain.batches import DEFAULT_TARGET_KEY, TargetKey, collate_parts, collate_samples
from pipetrain.errors import one_line
from pipetrain.runtime.launch import LOADER_DIED, die_with_parent
from pipetrain.streams import is_stream, passes


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
    """Building a minibatch failed (the dataset raised, a stream ended early, or a loader died or hung);
    the worker names itself."""


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


def read(recipe: Recipe, tasks: Sequence[Task]) -> Iterator[tuple[int, list[Any]]]:
    """A stream's minibatches for ``tasks`` (of one pass, in increasing positions), in order: the stream
    is read from its start once, each item drawn with its position's seed (see [Note: item seeds]),
    and the items no task takes are passed over."""
    if not tasks:
        return
    first = tasks[0]
    stream = recipe.eval_dataset if first.eval else recipe.dataset
    items, at = passes(stream, first.epoch), 0
    for task in tasks:
        with _own_rng():
            samples = []
            for j in task.items:
                assert j >= at, "a stream's minibatches are read in order"
                while at <= j:
                    _seed(item_seed(recipe.seed, first.epoch, first.eval, at))
                    try:
                        item = next(items)
                    except StopIteration:
                        raise LoadError(f"the stream ended after {at} items, but minibatch {task.mb} needs item {j}: "
                                        "a stream must yield the same items on every pass and in every process "
                                        "(its len(), or the count taken before training, said more)") from None
                    except Exception as e:  # the user's stream may raise anything
                        raise ItemFailed(at, one_line(e)) from e
                    at += 1
                samples.append(item)
            parts = collate_samples(samples, task.parts, recipe.target_key, recipe.collate_fn)
        yield task.mb, parts


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
        self._stream: Iterator[tuple[int, list[Any]]] | None = None

    def begin(self, tasks: list[Task]) -> None:
        self._tasks = {task.mb: task for task in tasks}
        self._stream = read(self.recipe, tasks) if tasks and _streamed(self.recipe, tasks[0]) else None

    def get(self, mb: int) -> list[Any]:
        task = self._tasks.pop(mb)
        try:
            if self._stream is None:
                return build(self.recipe, task)
            got, values = next(self._stream)
            assert got == mb, "a stream's minibatches are asked for in order"
            return values
        except ItemFailed as e:
            raise LoadError(f"the dataset failed on {_where(e.item, task.items)} of minibatch {mb}: "
                            f"{e.error}") from None

    def close(self) -> None:
        pass




def _streamed(recipe: Recipe, task: Task) -> bool:
    return is_stream(recipe.eval_dataset if task.eval else recipe.dataset)


@dataclass(frozen=True)
class _Failed:
    """What a loader hands back instead of a minibatch it could not build, as one line (an exception
    raised in a DataLoader worker would come back as its traceback)."""

    message: str


def _failed(task: Task, item: int | None, error: str) -> _Failed:
    return _Failed(f"loader {_loader_id()} failed on {_where(item, task.items)} of minibatch {task.mb}: {error}")


POLL_S = 2.0
"""How often a worker waiting for a minibatch checks that its loaders are alive."""


class Loaders:
    """A ``torch.utils.data.DataLoader`` whose ``n`` worker processes build this worker's minibatches
    ahead, ``prefetch`` each, in the order the worker needs them.

    A map-style dataset's loader is persistent: its sampler yields the worker's tasks (its shard, the
    first stage's inputs, the last stage's targets) pass after pass, and each loader builds what it is
    given. A stream's loaders start for each pass: loader k reads the stream and builds every n-th of the
    worker's minibatches (a stream cannot be entered in the middle), and the DataLoader hands them back
    in turn, which is the worker's order. Loaders are forked (the dataset is inherited, not pickled) and
    pin on a GPU worker. A loader's death is the worker's (``max_restarts`` restarts the job); a loader
    that builds nothing for ``timeout`` seconds fails the worker.
    """

    def __init__(self, recipe: Recipe, n: int, prefetch: int, timeout: float, pin: bool = False) -> None:
        self.recipe, self.n, self.timeout = recipe, n, timeout
        self._options: dict[str, Any] = dict(batch_size=None, collate_fn=_as_built, num_workers=n, prefetch_factor=prefetch,
                             pin_memory=pin, worker_init_fn=_start_loader, timeout=POLL_S,
                             multiprocessing_context="fork", generator=torch.Generator())
        # its own generator: each pass draws the loaders' base seed, which would move the worker's own
        # (dropout's) random stream
        # a loader's death is found by polling in get (below), not by torch's SIGCHLD handler, which
        # raises in whatever this process is running then: a backward, a send
        signal_handling._SIGCHLD_handler_set = True
        self._feed = _Feed()
        self._persistent = DataLoader(_Minibatches(recipe), sampler=self._feed, persistent_workers=True,
                                      **self._options)  # type: ignore[arg-type]
        self._batches: Iterator[Any] | None = None

    def begin(self, tasks: list[Task]) -> None:
        if not tasks:
            self._batches = None
        elif _streamed(self.recipe, tasks[0]):
            shares = _StreamShares(self.recipe, tasks, self.n)
            self._batches = iter(DataLoader(shares, **{**self._options, "num_workers": min(self.n, len(tasks))}))
        else:
            self._feed.tasks = tasks
            self._batches = iter(self._persistent)

    def get(self, mb: int) -> list[Any]:
        assert self._batches is not None, "a minibatch was asked for before the pass began"
        began = time.monotonic()
        while True:
            try:
                got = next(self._batches)
                break
            except (RuntimeError, OSError, EOFError) as e:  # a loader ended (reported by the DataLoader, or
                # a minibatch's shared memory lost with it), or nothing came in a poll
                dead = _dead(self._batches)
                if dead or "timed out" not in str(e):
                    raise LoadError(f"{LOADER_DIED}: {dead or one_line(e)} while building minibatch {mb}") from None
                if time.monotonic() - began > self.timeout:
                    raise LoadError(f"a loader built nothing for {self.timeout:g}s while building minibatch {mb} "
                                    "(a dataset item that never returns?)") from None
        if isinstance(got, _Failed):
            raise LoadError(got.message)
        done, values = got
        assert done == mb, "minibatches are asked for in the order they were planned"
        return values

    def close(self) -> None:
        """Stop the loaders."""
        self._batches = None
        running = self._persistent._iterator
        if running is not None:
            running._shutdown_workers()  # type: ignore[attr-defined]
        self._persistent._iterator = None


class _Feed(Sampler[Task]):
    """The sampler of a persistent DataLoader: the tasks of the pass that began last."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def __iter__(self) -> Iterator[Task]:
        return iter(list(self.tasks))

    def __len__(self) -> int:
        return len(self.tasks)


class _Minibatches(Dataset):
    """A map-style dataset whose index is a task and whose item is its built minibatch (or :class:`_Failed`)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def __getitem__(self, task: Task) -> tuple[int, list[Any]] | _Failed:
        try:
            return task.mb, build(self.recipe, task)
        except ItemFailed as e:
            return _failed(task, e.item, e.error)
        except Exception as e:  # collating the user's items may raise anything
            return _failed(task, None, one_line(e))


class _StreamShares(IterableDataset):
    """A stream's minibatches for ``tasks``, loader k of ``n`` building tasks k, k+n, ... (:func:`read`)."""

    def __init__(self, recipe: Recipe, tasks: list[Task], n: int) -> None:
        self.recipe, self.tasks, self.n = recipe, tasks, n

    def __iter__(self) -> Iterator[tuple[int, list[Any]] | _Failed]:
        mine = self.tasks[_loader_id()::min(self.n, len(self.tasks))]
        done = 0
        try:
            for built in read(self.recipe, mine):
                yield built
                done += 1
        except ItemFailed as e:
            yield _failed(mine[done], e.item, e.error)
        except LoadError as e:
            yield _Failed(str(e))
        except Exception as e:  # collating the user's items may raise anything
            yield _failed(mine[done], None, one_line(e))


def _dead(batches: Any) -> str:
    """Which of a DataLoader iterator's loaders ended and how, e.g. ``loader 1 (killed by SIGKILL)``."""
    dead = []
    for k, proc in enumerate(getattr(batches, "_workers", [])):
        proc.join(0.5)  # the SIGCHLD that reported it may come before the process is reaped
        code = proc.exitcode
        if code is not None:
            dead.append(f"loader {k} ({f'killed by {signal.Signals(-code).name}' if code < 0 else f'exit code {code}'})")
    return ", ".join(dead)


def _loader_id() -> int:
    info = get_worker_info()
    return info.id if info is not None else 0


def _as_built(value: Any) -> Any:
    """A DataLoader's collate_fn that keeps what a loader built."""
    return value


def _start_loader(k: int) -> None:
    """A loader begins: named for errors and tests, and killed with its worker."""
    multiprocessing.current_process().name = f"pipetrain-loader-{k}"
    die_with_parent()
