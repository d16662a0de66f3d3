"""How long a pipeline takes to start, and what each worker holds, as the model grows.

The question: does start-up (from the ``train`` call to the first update) and each worker's memory
follow its stage, not the whole model? The job is an ``nn.Sequential`` of ``Linear(2048, 2048)`` + ``ReLU``
pairs (16 MiB of float32 weights per pair) on 4 stages, SGD, one torch thread per worker, batch 16,
each run in a fresh process (so each pays for starting pipetrain's fork server, as a script's first
call does), in three forms:

* ``real``: the model built with its weights in the caller, which keeps it; each worker is sent its stage;
* ``weights``: the model built on the meta device, each worker reading its stage from a safetensors file
  written beforehand (the ``read_s`` column: reading one stage's tensors from that file in this
  process, what a worker's start-up includes on top);
* ``init``: the model built on the meta device, each worker initializing its stage.

Per run it prints the seconds from the ``train`` call (the model built before it) to the first forward
and to the first update, ``phases["start_s"]`` (the workers started until each holds its stage) and
each worker's peak resident memory. Run it under
``flock /tmp/pipetrain-bench.lock`` on a quiet machine::

    python benchmarks/startup.py --pairs 32 64 --schedules pipedream 1f1b-flush --forms real weights init

``--forms real`` needs nothing newer than ``pipetrain.train`` itself, so it also runs against an older
checkout (``PYTHONPATH=OLD_CHECKOUT``), for a before and after.
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain

WIDTH = 2048


def model(pairs: int) -> nn.Sequential:
    """``pairs`` of Linear(2048, 2048) and ReLU (16 MiB of weights per Linear): 2 * pairs layers."""
    return nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def schedule_of(name: str) -> Any:
    return pipetrain.OneFOneBFlush(microbatches=2) if name == "1f1b-flush" else name


def run(pairs: int, schedule: str, form: str, weights: str) -> dict[str, Any]:
    """One job; the model is built inside the timing, as a user's script builds it before calling train."""
    warnings.simplefilter("ignore", pipetrain.PipetrainWarning)  # a meta model is not gathered: no need here
    data = TensorDataset(torch.randn(64, WIDTH), torch.randn(64, WIDTH))
    layers = 2 * pairs
    stages = [0, layers // 4, layers // 2, 3 * layers // 4]
    if form == "real":
        net, extra = model(pairs), {}
    else:
        with torch.device("meta"):
            net = model(pairs)
        extra = {"weights": weights} if form == "weights" else {}
    called = time.perf_counter()
    result = pipetrain.train(net, data, loss_fn=nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01), stages=stages,
                             schedule=schedule_of(schedule), batch_size=16, epochs=1, threads=1, shuffle=False,
                             trace=True, **extra)
    first_forward = min(start for records in result.traces for action, start, _ in records if action.startswith("F"))
    return {"pairs": pairs, "schedule": schedule, "form": form,
            "model_gib": sum(p.numel() * 4 for p in net.parameters()) / 2**30,
            "first_forward_s": first_forward - called, "first_update_s": result.history[0]["time"] - called,
            "start_s": result.phases["start_s"], "peak_gib": [p / 2**30 for p in result.peak_memory]}


def in_fresh_process(pairs: int, schedule: str, form: str, weights: Path) -> dict[str, Any]:
    """:func:`run` in a new Python process, its row back as JSON on the last line of its output."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import startup; "
            f"print(json.dumps(startup.run({pairs}, {schedule!r}, {form!r}, {str(weights)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_stage_s(weights: Path, pairs: int) -> float:
    """Seconds to read the first stage's tensors from ``weights`` in this process."""
    from pipetrain.weightfiles import WeightFiles
    keys = [k for k in WeightFiles.open(weights).keys if int(k.split(".")[0]) < pairs // 2]
    begun = time.perf_counter()
    WeightFiles.open(weights).read(keys)
    return time.perf_counter() - begun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[32, 64],
                        help="Linear+ReLU pairs (a Linear is 16 MiB): 32 is 0.5 GiB, 64 is 1 GiB")
    parser.add_argument("--schedules", nargs="+", default=["pipedream", "1f1b-flush"])
    parser.add_argument("--forms", nargs="+", default=["real", "weights", "init"], choices=["real", "weights", "init"])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print("| model GiB | schedule | form | call to first forward s | to first update s | start_s | read one stage s | "
          "peak RSS per worker GiB |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="pipetrain-startup-") as tmp:
        for pairs in args.pairs:
            weights = Path(tmp) / f"model{pairs}.safetensors"
            if "weights" in args.forms:
                from pipetrain.weightfiles import write_shard
                write_shard(weights, model(pairs).state_dict())
            read_s = read_stage_s(weights, pairs) if "weights" in args.forms else None
            for schedule in args.schedules:
                for form in args.forms:
                    row = in_fresh_process(pairs, schedule, form, weights)
                    row["read_stage_s"] = read_s if form == "weights" else None
                    rows.append(row)
                    read = f"{read_s:.1f}" if form == "weights" and read_s is not None else "-"
                    print(f"| {row['model_gib']:.2f} | {schedule} | {form} | {row['first_forward_s']:.1f} | "
                          f"{row['first_update_s']:.1f} | "
                          f"{row['start_s']:.1f} | {read} | {' / '.join(f'{p:.2f}' for p in row['peak_gib'])} |",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
