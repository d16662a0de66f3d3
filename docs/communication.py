"""Write docs/communication.md: bytes each worker sends per minibatch, pipeline vs data-parallel BSP.

Usage: ``python docs/communication.py [PROFILE_DIR]``. Each model's ``<model>.graph.txt`` is taken from
PROFILE_DIR (e.g. PipeDream's full set of published profiles), else from the profiles the package ships
(``pipetrain/data/pipedream``); models found in neither are left out. Takes a few seconds.

Counting (one convention for both columns, see the notes written into the table):
* data-parallel BSP with M workers, ring allreduce: each worker sends 2 (M - 1) |w| / M bytes per
  minibatch (``costs.dp_sync_bytes(..., algorithm="ring")``) and receives as many;
* a pipeline worker of stage s, per minibatch it processes, sends the activations of the cut after s,
  the gradients of the cut before s (same size as those activations), and its share of the stage's
  replica sync, 2 (m - 1) |w_s| / m for m replicas; it receives as many.
The plans come from ``pipetrain.plan`` with the same ring volume, so planner and table agree.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipetrain.costs import dp_sync_bytes
from pipetrain.planning import Plan, plan
from pipetrain.planning.units import format_bytes
from pipetrain.profiling import Profile
from pipetrain.stagecost import stage_costs

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "inception_v3", "gnmt")
WORKERS, BANDWIDTH = (4, 8), "10Gbit"


def find_profile(model: str) -> Path | None:
    dirs = [Path(d) for d in sys.argv[1:2]] + [ROOT / "pipetrain" / "data" / "pipedream"]
    return next((d / f"{model}.graph.txt" for d in dirs if (d / f"{model}.graph.txt").is_file()), None)


def pipeline_bytes(profile: Profile, chosen: Plan) -> list[float]:
    """Bytes each worker sends per minibatch it processes, worker by worker."""
    costs = stage_costs(profile, chosen.boundaries)
    last = len(costs) - 1
    per_stage = [(costs[s].output_bytes if s < last else 0.0) + (costs[s - 1].output_bytes if s > 0 else 0.0)
                 + dp_sync_bytes(costs[s].parameter_bytes, r, "ring") for s, r in enumerate(chosen.replicas)]
    return [b for b, r in zip(per_stage, chosen.replicas) for _ in range(r)]


def rows() -> tuple[list[str], list[Path]]:
    """The table's rows, and the profile files they came from."""
    out, used = [], []
    for model in MODELS:
        path = find_profile(model)
        if path is None:
            print(f"no {model}.graph.txt found; left out")
            continue
        used.append(path)
        profile = Profile.load(path)
        weights = sum(layer.parameter_bytes for layer in profile.layers)
        for m in WORKERS:
            dp = dp_sync_bytes(weights, m, "ring")
            best = plan(profile, m, BANDWIDTH, allreduce="ring")
            straight = plan(profile, m, BANDWIDTH, straight=True, allreduce="ring")
            for chosen in (best,) if best.config == straight.config else (best, straight):
                sent = pipeline_bytes(profile, chosen)
                out.append(f"| {model} | {m} | {chosen.config} | {format_bytes(dp)} | {format_bytes(max(sent))} "
                           f"| {format_bytes(sum(sent) / len(sent))} | {max(sent) / dp:.2f} |")
    return out, used


def main() -> None:
    lines, used = rows()
    table = "\n".join(lines)
    sources = "\n".join(f"- `{p.relative_to(ROOT)}`" if p.is_relative_to(ROOT) else f"- `PROFILE_DIR/{p.name}`"
                        for p in used)
    text = f"""# Communication per worker: pipeline vs data-parallel BSP

Bytes each worker **sends** per minibatch it processes (it receives as many), at the batch size
each PipeDream profile was taken at (e.g. 128 for vgg16 and resnet50, 256 for alexnet), for the
plans `pipetrain.plan(profile, M, "{BANDWIDTH}", allreduce="ring")` chooses (config: replicas
per stage, PipeDream's notation; a single number is plain data parallelism) and for straight
pipelines (`straight=True`) where those differ.

- **DP-BSP**: ring allreduce of all weights |w| over M workers, 2 (M − 1) |w| / M per worker.
  PipeDream §3.2 estimates 4 (M − 1) |w| / M per worker for a sharded parameter server; read as
  bytes sent plus bytes received, that is the ring's volume.
- **pipeline**: a worker of stage s sends the activations crossing the cut after s and the gradients
  crossing the cut before s (same size), plus, for a stage on m replicas, its ring-allreduce share of
  the stage's weights, 2 (m − 1) |w_s| / m. *max* is the busiest worker, *mean* the average over
  workers; *max / DP* below 1 means the pipeline's busiest worker sends less than every DP worker.

| model | M | config | DP-BSP | pipeline max | pipeline mean | max / DP |
|---|---|---|---|---|---|---|
{table}

Made by `python docs/communication.py [PROFILE_DIR]` from PipeDream's published profiles (MIT licence;
the package ships four, PROFILE_DIR holds the others):

{sources}
"""
    path = Path(__file__).resolve().parent / "communication.md"
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
