"""How much of pipedream's time on vgg-like goes into copying weights and gradients (issue 5, target a).

``pipetrain.runtime.weights.Stashing`` clones a stage's parameters for every new weight version
(``_copy``, once per minibatch at a stage that updates every minibatch) and clones each gradient when
it hands it to the live parameters (``after_backward``). On vgg-like's FC stage that is 2 x 100 MB per
minibatch. Neither is needed at the output stage, whose forward and backward of a minibatch are
adjacent (no update between them, so the live weights are the stashed ones), and the gradient clone
is never needed (the stashed copy's ``.grad`` is dropped right after). This script runs pipedream as
it is and with a patched policy that skips both, alternating, on the emulated cluster, and prints
samples/s and each worker's ms per minibatch by action. The patch changes no number the model
computes: the same gradients reach the same weights.

    flock /tmp/pipetrain-bench.lock python benchmarks/stash_overhead.py --stages 0,10 --rounds 3
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so ranks can import this module by name

from pipetrain.bench.peers import PeerConfig, pipetrain_job  # noqa: E402
from pipetrain.runtime import weights  # noqa: E402


class _MoveGradients(weights.Stashing):
    """Stashing, but the gradient moves to the live parameter instead of being cloned."""

    def after_backward(self, mb: int) -> None:
        used = self._stash.pop(mb)
        for k, p in self.params.items():
            g = used[k].grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
            used[k].grad = None


def lean_job(cfg: PeerConfig, stages: list[int], link: str) -> dict:
    """pipetrain_job with the output stage on live weights and no gradient clones elsewhere."""
    last = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1  # straight pipeline: rank = stage
    weights.POLICIES["stash"] = weights.Live if last else _MoveGradients
    return pipetrain_job(cfg, "pipedream", stages, 1, link, True)


def as_is_job(cfg: PeerConfig, stages: list[int], link: str) -> dict:
    return pipetrain_job(cfg, "pipedream", stages, 1, link, True)


def main() -> None:
    from pipetrain.bench.cluster import EmulatedCluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,10")
    p.add_argument("--link", default="1gbit")
    p.add_argument("--rounds", type=int, default=3, help="as-is / lean pairs, alternating")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    me = importlib.import_module("benchmarks.stash_overhead")  # pickled by module name, not __main__
    cfg = PeerConfig(model="vgg-like", batch_size=args.batch_size, warmup=3, windows=5, steps_per_window=3)
    stages = [int(b) for b in args.stages.split(",")]
    rates: dict[str, list[float]] = {"as is": [], "lean": []}
    port = 29700
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with EmulatedCluster(len(stages), link=args.link) as c:
        for _ in range(args.rounds):
            for name, fn in (("as is", me.as_is_job), ("lean", me.lean_job)):
                port += 1
                r = c.spawn(fn, (cfg, stages, args.link), port=port)[0]
                rates[name].append(r["samples_per_s"])
                ms = "; ".join(f"rank {i}: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(b.items()))
                               for i, b in enumerate(r["breakdown"]))
                print(f"{name:>6}: {r['samples_per_s']:6.1f} samples/s  ms per minibatch: {ms}", flush=True)
    a, b = statistics.median(rates["as is"]), statistics.median(rates["lean"])
    print(f"median samples/s: as is {a:.1f}, lean {b:.1f} ({b / a:.2f}x); load average at end: "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
