"""Entry point of one rank of :meth:`EmulatedCluster.spawn`, run inside a host namespace.

``python -m pipetrain.bench._host WORKDIR RANK``: reads ``WORKDIR/job.pkl`` (the parent's ``sys.path``,
then ``(fn, args)``), writes ``resultRANK.pt`` or ``errorRANK.txt`` (first line: the message).
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

import torch

from pipetrain.errors import one_line
from pipetrain.runtime.launch import keep_freed_memory


def main(workdir: str, rank: str) -> None:
    code = 0
    keep_freed_memory()  # every system's processes alike, as pipetrain's own launcher does
    try:
        with open(Path(workdir) / "job.pkl", "rb") as f:
            sys.path[:] = [*pickle.load(f), *(p for p in sys.path if p)]
            fn, args = pickle.load(f)
        torch.save(fn(*args), Path(workdir) / f"result{rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then the process ends
        (Path(workdir) / f"error{rank}.txt").write_text(f"rank {rank}: {one_line(e, None)}\n"
                                                        + traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # As in pipetrain.runtime.launch: [Note: hard exit] skips a process-group teardown that may hang.
    os._exit(code)


if __name__ == "__main__":
    main(*sys.argv[1:3])
