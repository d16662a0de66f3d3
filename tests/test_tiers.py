"""The fast tier is enforced: a test not marked ``multiprocess`` that starts a process fails at once,
and says how to fix it. Nothing here starts a process."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REFUSED, STARTS, ProcessStartRefused, refuse_process_starts
from pipetrain.runtime.launch import spawn

ORIGINALS = [(owner, attr, getattr(owner, attr)) for owner, attr in STARTS if hasattr(owner, attr)]
"""Where Python starts a process, as this module found it at collection, before any test ran."""


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"]),
    lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: multiprocessing.get_context("forkserver").Process(target=print).start(),
    lambda: os.fork(),
    lambda: os.system("true"),
    lambda: spawn(print, 2, ()),  # pipetrain's own launcher
], ids=["subprocess.run", "Popen", "fork context", "spawn context", "forkserver context", "os.fork", "os.system",
        "pipetrain spawn"])
def test_every_way_to_start_a_process_is_refused_and_recorded(monkeypatch: pytest.MonkeyPatch, start) -> None:
    attempts = refuse_process_starts(monkeypatch)  # over the tier's own refusal: this test's attempts stay here
    with pytest.raises(ProcessStartRefused, match=REFUSED):
        start()
    assert len(attempts) == 1


def test_the_tier_fails_an_unmarked_test_that_starts_a_process_and_leaves_a_marked_one_alone(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in this process (no process starts: the inner tests only try to, or look): an unmarked test
    that starts a process fails with the message, even when it catches the error; a marked one finds
    Python's own functions in place."""
    for owner, attr, original in ORIGINALS:  # as a marked test would find them
        monkeypatch.setattr(owner, attr, original)
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner="""
        import multiprocessing.process
        import subprocess

        import pytest

        def test_unmarked_starts():
            subprocess.run(["true"])

        def test_unmarked_catches_the_refusal():
            try:
                subprocess.run(["true"])
            except RuntimeError:
                pass

        def test_unmarked_starts_nothing():
            pass

        @pytest.mark.multiprocess
        def test_marked():
            assert subprocess.Popen._execute_child.__qualname__ == "Popen._execute_child"
            assert multiprocessing.process.BaseProcess.start.__qualname__ == "BaseProcess.start"
    """)
    reports = pytester.inline_run("-p", "no:cacheprovider", "-o", "addopts=").getreports("pytest_runtest_logreport")
    outcomes = {(r.head_line, r.when): (r.outcome, str(r.longrepr)) for r in reports if r.outcome != "passed"}
    assert outcomes.keys() == {("test_unmarked_starts", "call"), ("test_unmarked_catches_the_refusal", "teardown")}
    assert all(outcome == "failed" and f"{REFUSED} (it called Popen._execute_child)" in text
               for outcome, text in outcomes.values())
    assert sum(r.passed for r in reports if r.when == "call") == 3
