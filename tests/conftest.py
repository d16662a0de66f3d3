"""The two test tiers: a test that starts a process is marked ``multiprocess``; every other test is
refused any process start, so the fast tier (``pytest -m "not multiprocess"``) stays fast and one."""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

import pytest

pytest_plugins = ["pytester"]

REFUSED = "this test starts a process: mark it multiprocess"
"""What an unmarked test that starts a process is told (it is also failed when it catches the error)."""

STARTS = ((multiprocessing.process.BaseProcess, "start"),  # every multiprocessing context, torch's too
          (subprocess.Popen, "_execute_child"),  # subprocess.run, check_output, Popen however imported
          (os, "fork"), (os, "forkpty"), (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp"))
"""Where Python starts a process; in-process torch.distributed groups (world size 1) start none."""


def pytest_configure(config: pytest.Config) -> None:
    """Build matplotlib's font cache before any test runs: on a machine without one, the first import
    of ``matplotlib.pyplot`` runs ``fc-list``, a process start the fast tier would refuse to whichever
    test happens to draw first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401  (importing it builds the cache)


class ProcessStartRefused(RuntimeError):
    """A test outside the multiprocess tier tried to start a process."""


def refuse_process_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every way in :data:`STARTS` raise :class:`ProcessStartRefused` until ``monkeypatch`` is
    undone; the list it returns names each attempt, even one the test caught."""
    attempts: list[str] = []

    def refuse(name: str):
        def refused(*args, **kwargs):
            attempts.append(name)
            raise ProcessStartRefused(f"{REFUSED} (it called {name})")
        return refused

    for owner, attr in STARTS:
        if hasattr(owner, attr):
            monkeypatch.setattr(owner, attr, refuse(f"{getattr(owner, '__name__', owner)}.{attr}"))
    return attempts


CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def _process_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refuse process starts in a test not marked ``multiprocess``; one that caught the refusal and
    passed fails here."""
    if request.node.get_closest_marker("multiprocess") is not None:
        yield
        return
    attempts = refuse_process_starts(monkeypatch)
    yield
    if attempts and not request.node.stash.get(CALL_FAILED, False):
        pytest.fail(f"{REFUSED} (it called {', '.join(dict.fromkeys(attempts))})", pytrace=False)
