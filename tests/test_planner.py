"""The partitioner (PipeDream §3.2), its cost formulas, the plan as data and ``pipetrain plan``.

The property tests compare the dynamic program with a brute force, written here from the paper and
not from pipetrain.costs, over every split into stages and every replica count per stage.

``test_large_solve_is_fast`` prints how long 200 layers x 64 workers with replication take to solve;
its bound only catches a solver that is no longer vectorized.
"""
import itertools
import json
import math
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipetrain
from pipetrain import cli
from pipetrain.costs import dp_sync_bytes, in_flight, stage_memory_bytes
from pipetrain.planning import Plan, StagePlan, check_fits, parse_bandwidth, parse_bytes, partition, plan
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.schedule import warmup

DATA = Path(pipetrain.__file__).parent / "data" / "pipedream"
VGG16 = DATA / "vgg16.graph.txt"


def make_profile(layers, input_bytes=0):
    """``layers``: (compute seconds, activation bytes, parameter bytes) per layer."""
    return Profile([LayerProfile(str(k), c / 3, 2 * c / 3, a, w) for k, (c, a, w) in enumerate(layers)],
                   batch_size=32, device="cpu", input_bytes=input_bytes)


def compositions(total, parts):
    """Every tuple of ``parts`` positive integers summing to ``total``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def brute_force(layers, input_bytes, workers, bandwidth, *, straight=False, fewer=False, memory=None,
                per_server=None, intra=None, ring=False, allowed=None):
    """Least slowest-stage time over every split and replica assignment, straight from §3.2.

    Workers are numbered from the output stage backwards, each stage taking consecutive numbers; a
    stage's sync, and a boundary between two stages, use the intra-server bandwidth only when all
    the workers involved share one server; ``allowed``: the only boundaries a stage may end at (default
    every one). A worker's memory: its weights, a stashed copy per
    minibatch in flight where more than one is (§3.4: with one, no update comes between its forward
    and backward), the activations of each in flight, its gradient (ZeRO §3.1's model states; every
    parameter trains) and, on a replicated stage, the flat copy of the gradient its allreduce holds.
    """
    n_layers = len(layers)
    per_server = per_server or workers
    intra = intra or bandwidth
    best = math.inf
    for cut_here in itertools.product([False, True], repeat=n_layers - 1):
        starts = [0] + [k + 1 for k, c in enumerate(cut_here) if c]
        if allowed is not None and not set(starts[1:]) <= set(allowed):
            continue
        spans = list(zip(starts, [*starts[1:], n_layers]))
        n = len(spans)
        totals = range(1, workers + 1) if fewer else [workers]
        if straight:
            options = [(1,) * n] if n in totals else []
        else:
            options = [reps for total in totals if total >= n for reps in compositions(total, n)]
        for reps in options:
            lows = [sum(reps[s + 1:]) for s in range(n)]  # first worker number of each stage
            server = [(lo // per_server, (lo + r - 1) // per_server) for lo, r in zip(lows, reps)]
            worst = 0.0
            for s, ((a, b), r) in enumerate(zip(spans, reps)):
                compute = sum(c for c, _, _ in layers[a:b])
                params = sum(w for _, _, w in layers[a:b])
                in_one = server[s][0] == server[s][1]
                volume = (2 if ring else 4) * (r - 1) * params / r
                worst = max(worst, max(compute, volume / (intra if in_one else bandwidth)) / r)
                if memory is not None:
                    flight = math.ceil(sum(reps[s:]) / r)
                    held = (input_bytes if a == 0 else layers[a - 1][1]) + sum(x for _, x, _ in layers[a:b])
                    copies = flight if flight > 1 else 0
                    gradients = params * (2 if r > 1 else 1)
                    if params * (1 + copies) + gradients + held * flight > memory:
                        worst = math.inf
                if s < n - 1:
                    joined = in_one and server[s + 1][0] == server[s + 1][1] == server[s][0]
                    worst = max(worst, 2 * layers[b - 1][1] / (intra if joined else bandwidth))
            best = min(best, worst)
    return best


layer = st.tuples(st.floats(0.001, 1.0), st.integers(0, 2 * 10 ** 9), st.integers(0, 4 * 10 ** 9))
small = st.lists(layer, min_size=1, max_size=7)


@settings(max_examples=150, deadline=None)
@given(small, st.integers(1, 6), st.sampled_from([1e8, 1.25e9, 1e11]), st.booleans(), st.booleans(),
       st.booleans())
def test_matches_brute_force(layers, workers, bandwidth, straight, fewer, ring):
    profile = make_profile(layers)
    expect = brute_force(layers, 0, workers, bandwidth, straight=straight, fewer=fewer, ring=ring)
    kw = dict(straight=straight, fewer_workers=fewer, allreduce="ring" if ring else "ps")
    if expect == math.inf:
        with pytest.raises(ValueError, match="straight"):
            plan(profile, workers, bandwidth, **kw)
        return
    result = plan(profile, workers, bandwidth, **kw)
    assert result.stage_time_s == pytest.approx(expect, rel=1e-6)
    assert result.workers == workers or (fewer and result.workers < workers)
    assert straight is False or set(result.replicas) == {1}
    # the reconstructed stages explain the predicted time
    assert max(max(s.time_s, s.boundary_s) for s in result.stages) == pytest.approx(result.stage_time_s)


@settings(max_examples=150, deadline=None)
@given(small, st.integers(0, 10 ** 9), st.integers(1, 6), st.integers(1, 3), st.booleans(),
       st.sampled_from([None, 2e9, 1e10, 3e10]))
def test_matches_brute_force_with_servers_and_memory(layers, input_bytes, workers, per_server, fewer, memory):
    profile = make_profile(layers, input_bytes)
    expect = brute_force(layers, input_bytes, workers, 1.25e9, fewer=fewer, memory=memory,
                         per_server=per_server, intra=1.25e10)
    kw = dict(fewer_workers=fewer, memory=memory, workers_per_server=per_server, intra_bandwidth=1.25e10)
    if expect == math.inf:
        with pytest.raises(ValueError, match="memory"):
            plan(profile, workers, 1.25e9, **kw)
        return
    result = plan(profile, workers, 1.25e9, **kw)
    assert result.stage_time_s == pytest.approx(expect, rel=1e-6)
    assert max(max(s.time_s, s.boundary_s) for s in result.stages) == pytest.approx(result.stage_time_s)


def test_a_long_profile_is_cut_where_least_crosses_in_each_share_of_its_compute():
    """Ten layers of equal compute, 4 positions kept: the nine boundaries fall in thirds of the compute
    (1-3, 4-6, 7-9), and each third keeps its boundary with the fewest bytes crossing."""
    crossing = [50, 10, 30, 40, 60, 20, 5, 70, 80, 0]  # bytes leaving each layer
    profile = make_profile([(0.1, a, 0) for a in crossing])
    assert partition.cut_positions(profile, 4).tolist() == [0, 2, 6, 7, 10]
    assert partition.cut_positions(profile, 10).tolist() == list(range(11))


@settings(max_examples=100, deadline=None)
@given(st.lists(layer, min_size=4, max_size=7), st.integers(1, 5), st.sampled_from([1e8, 1.25e9]), st.booleans())
def test_a_long_profile_is_planned_over_its_kept_boundaries(layers, workers, bandwidth, fewer):
    """With fewer positions kept than layers, the plan is the best of those cut only at kept boundaries."""
    profile = make_profile(layers)
    kept = partition.cut_positions(profile, 3).tolist()
    expect = brute_force(layers, 0, workers, bandwidth, fewer=fewer, allowed=kept[1:-1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(partition, "CUT_BUDGET", 0)
        patch.setattr(partition, "MIN_CUTS", 3)
        if expect == math.inf:
            with pytest.raises(ValueError):
                plan(profile, workers, bandwidth, fewer_workers=fewer)
            return
        result = plan(profile, workers, bandwidth, fewer_workers=fewer)
    assert result.stage_time_s == pytest.approx(expect, rel=1e-6)
    assert {s.first_layer for s in result.stages} <= set(kept)
    assert result.options["boundaries_weighed"] == len(kept) - 2


def test_straight_uses_one_worker_per_stage():
    profile = make_profile([(1.0, 10, 10 ** 9)] * 6)
    result = plan(profile, 3, "10Gbit", straight=True)
    assert result.config == "1-1-1" and result.boundaries == [0, 2, 4]
    assert result.stage_time_s == pytest.approx(2.0) and result.noam == 3
    with pytest.raises(ValueError, match="at most 6 workers"):
        plan(profile, 7, "10Gbit", straight=True)
    assert plan(profile, 7, "10Gbit", straight=True, fewer_workers=True).config == "1-1-1-1-1-1"


def test_building_the_minibatch_counts_on_the_stage_that_does_it():
    """4 layers of 1 s, 2 workers, one each, nothing to send: the cut falls in the middle (2 s a stage).
    A first stage that also builds the inputs in 2 s holds one layer (3 s against 3 s); a last stage that
    builds the targets in 2 s, one layer too."""
    def cut(**building: float) -> tuple[int, list[float]]:
        profile = make_profile([(1.0, 0, 0)] * 4)
        profile.inputs_s, profile.targets_s = building.get("inputs_s", 0.0), building.get("targets_s", 0.0)
        chosen = plan(profile, 2, 1e9, straight=True)
        return chosen.stages[1].first_layer, [s.time_s for s in chosen.stages]

    assert cut() == (2, [pytest.approx(2.0)] * 2)
    assert cut(inputs_s=2.0) == (1, [pytest.approx(3.0)] * 2)
    assert cut(targets_s=2.0) == (3, [pytest.approx(3.0)] * 2)


def test_memory_limit_excludes_configs():
    # Two heavy layers: unconstrained, pure data parallelism wins; each replica then holds all the
    # weights, their gradient and its allreduce copy (one minibatch in flight: no stashed version),
    # which a limit can forbid.
    profile = make_profile([(1.5, 1000, 4 * 10 ** 6), (0.5, 1000, 4 * 10 ** 6)])
    assert plan(profile, 2, "100Gbit").config == "2"
    whole = stage_memory_bytes(8e6, 2000, in_flight(2, 2), weight_versions=0) + 2 * 8e6
    assert whole == 3 * 8e6 + 2000
    limited = plan(profile, 2, "100Gbit", memory=whole - 1)
    assert limited.config == "1-1" and limited.boundaries == [0, 1]
    with pytest.raises(ValueError, match="no configuration .* fits within"):
        plan(profile, 2, "100Gbit", memory=1e6)


def test_fewer_workers_stops_where_more_do_not_help():
    # One layer that is all weights: replicas only add sync time, so one worker is best.
    profile = make_profile([(0.01, 10, 10 ** 9)])
    assert plan(profile, 4, "1Gbit").workers == 4
    assert plan(profile, 4, "1Gbit", fewer_workers=True).config == "1"


def test_faster_servers_never_hurt():
    profile = Profile.load(VGG16)
    flat = plan(profile, 8, "10Gbit")
    servers = plan(profile, 8, "10Gbit", workers_per_server=4, intra_bandwidth="100Gbit")
    assert servers.stage_time_s <= flat.stage_time_s


def test_vgg16_matches_the_paper_config():
    """Table 1: VGG16 on 8 machines of Cluster-B (10 Gbit/s) runs as 7-1."""
    result = plan(VGG16, 8, "10Gbit")
    assert result.config == "7-1" and result.noam == 2
    assert result.speedup_vs_one > result.speedup_vs_dp > 1
    assert result.options["profile"] == str(VGG16)


def test_large_solve_is_fast():
    layers = [(0.001 + 0.01 * ((k * 37) % 11) / 11, 10 ** 6 * (1 + k % 7), 10 ** 6 * (k % 5)) for k in range(200)]
    profile = make_profile(layers)
    t0 = time.perf_counter()
    result = plan(profile, 64, "10Gbit")
    took = time.perf_counter() - t0
    print(f"\n200 layers x 64 workers: solved in {took:.3f} s ({result.config})")
    assert result.workers == 64
    assert took < 5.0  # generous: the point is O(N^2 M^2) vectorized, not a benchmark


def test_plan_round_trips_through_json(tmp_path):
    result = plan(VGG16, 8, "10Gbit")
    path = tmp_path / "plan.json"
    result.save(path)
    again = Plan.load(path)
    assert again == result
    assert (again.config, again.boundaries, again.replicas) == ("7-1", [0, 24], [7, 1])
    assert Plan.from_dict(json.loads(path.read_text())).stages[1] == StagePlan(24, 39, 1, result.stages[1].time_s)
    assert result.stages[0].boundary_s == pytest.approx(2 * 51380224 / 1.25e9)  # 2 C after node25 MaxPool2d


def test_bad_plans_and_mismatched_models_are_one_line_errors(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "pipetrain-plan", "version": 1, "stages": [{"first_layer": 1}]}')
    with pytest.raises(ValueError, match=f"^{bad}: malformed plan .*regenerate it with `pipetrain plan`$"):
        Plan.load(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError, match=f"^{bad}: not valid JSON"):
        Plan.load(bad)
    result = plan(VGG16, 8, "10Gbit")
    check_fits(result, 40, "plan.json")
    for made in (result, Profile.load(VGG16)):
        with pytest.raises(ValueError) as e:
            check_fits(made, 12, "x.json")
        assert "\n" not in str(e.value)
        assert "x.json: made for a model of 40 layers but this model has 12; re-run `pipetrain profile`" in str(e.value)


def test_bad_arguments():
    profile = Profile.load(VGG16)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        plan(profile, 0)
    with pytest.raises(ValueError, match="needs both workers_per_server and intra_bandwidth"):
        plan(profile, 8, workers_per_server=4)
    with pytest.raises(ValueError, match="unknown sync algorithm"):
        plan(profile, 8, allreduce="tree")
    with pytest.raises(ValueError, match="layer 0 .* negative"):
        plan(make_profile([(-1.0, 1, 1)]), 1)


def test_units():
    assert parse_bandwidth("10Gbit") == 1.25e9
    assert parse_bandwidth("1gbit") == 1.25e8
    assert parse_bandwidth("100Mbit") == 1.25e7
    assert parse_bandwidth("25Gbit") == parse_bandwidth("25 Gbit/s") == 25e9 / 8
    assert parse_bandwidth("25Gbps") == 25e9  # as tc reads it: bytes per second
    assert parse_bandwidth("1.25GB/s") == 1.25e9
    assert parse_bandwidth(5e8) == 5e8
    assert parse_bytes("16GiB") == 16 * 2 ** 30 and parse_bytes("512MB") == 512e6
    for bad in ("fast", "10G", "-1Gbit", ""):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_cost_formulas_follow_the_papers():
    assert dp_sync_bytes(100.0, 4) == 4 * 3 * 100 / 4  # PipeDream §3.2, parameter server
    assert dp_sync_bytes(100.0, 4, "ring") == 2 * 3 * 100 / 4
    assert dp_sync_bytes(100.0, 1) == 0
    for replicas in ([2, 1], [1, 1, 1, 1], [3, 2, 1]):  # the planner's in-flight count is the schedule's
        for s in range(len(replicas)):
            assert in_flight(replicas[s], sum(replicas[s:])) == warmup(replicas, s)


def run_cli(capsys, *args):
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "plan", str(VGG16), "--workers", "8", "--bandwidth", "10Gbit", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("config", "stages", "noam", "stage_time_s", "speedup_vs_one", "speedup_vs_dp"):
        assert key in data
    assert data["config"] == "7-1" and set(data["stages"][0]) >= {"first_layer", "last_layer", "replicas"}
    saved = tmp_path / "plan.json"
    code, out, _ = run_cli(capsys, "plan", str(VGG16), "--workers", "8", "--bandwidth", "10Gbit",
                           "-o", str(saved))
    assert code == 0 and Plan.load(saved).config == "7-1"
    assert "config 7-1" in out and "NOAM 2" in out
    assert re.search(r"^ +0 +0-23 +7 +0\.08887 +0\.08221 +node2 Conv2d", out, re.M)
    assert "s per minibatch at the slowest stage" in out and "x one worker" in out and "x data parallelism" in out
    assert "not priced in samples/s: the profile records no batch size; give it with --batch-size B" in out
    code, out, _ = run_cli(capsys, "plan", str(VGG16), "--workers", "16", "--bandwidth", "10Gbit",
                           "--workers-per-server", "4", "--intra-bandwidth", "100Gbit", "--memory", "64GiB",
                           "--allreduce", "ring", "--fewer-workers")
    assert code == 0 and "between servers of 4" in out


def test_cli_plan_errors_are_one_line(capsys, tmp_path):
    bad = tmp_path / "broken.txt"
    bad.write_text("node1 -- Input -- forward_compute_time=1.0\n")
    code, _, err = run_cli(capsys, "plan", str(bad), "--workers", "2")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"pipetrain plan: error: {bad}:1: cannot read node line")
    code, _, err = run_cli(capsys, "plan", str(VGG16), "--workers", "50", "--straight")
    assert code == 1 and "at most 40 workers" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "plan", str(VGG16), "--workers", "8", "--bandwidth", "fast")
    assert code == 1 and "cannot read bandwidth 'fast'" in err


def test_price_stages_prices_a_plan_given_by_hand_as_the_partitioner_does():
    """Two layers: 0.3 s and 0.1 s of compute, 120 MB of weights in the first, 10 MB crossing the cut,
    1 GB/s. As 3-1 with a parameter server (§3.2): the first stage syncs 4 x 2/3 x 120 MB = 320 MB in
    0.32 s, so T = max(0.3, 0.32) / 3; the cut costs 2 x 10 ms; the second stage 0.1 s. With each sync
    added to its stage's compute, T = (0.3 + 0.32) / 3. The partitioner's own plan is priced alike."""
    from pipetrain.planning.partition import price_stages

    layers = [LayerProfile("a", 0.1, 0.2, 10_000_000, 120_000_000), LayerProfile("b", 0.05, 0.05, 0, 0)]
    profile = Profile(layers, batch_size=8, device="test")
    hidden = price_stages(profile, [0, 1], [3, 1], 1e9)
    assert [(s.first_layer, s.last_layer, s.replicas) for s in hidden.stages] == [(0, 0, 3), (1, 1, 1)]
    assert hidden.stages[0].time_s == pytest.approx(0.32 / 3)
    assert hidden.stages[0].boundary_s == pytest.approx(0.02)
    assert (hidden.stages[1].time_s, hidden.stages[1].boundary_s) == (pytest.approx(0.1), 0.0)
    assert hidden.stage_time_s == pytest.approx(0.32 / 3) and hidden.speedup_vs_one == pytest.approx(0.4 * 3 / 0.32)
    added = price_stages(profile, [0, 1], [3, 1], 1e9, sync_overlaps=False)
    assert added.stages[0].time_s == pytest.approx(0.62 / 3) and added.config == "3-1"
    vgg = Profile.load(Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt")
    chosen = plan(vgg, 8, "10Gbit")
    again = price_stages(vgg, chosen.boundaries, chosen.replicas, "10Gbit")
    assert again.stages == pytest.approx(chosen.stages) and again.stage_time_s == pytest.approx(chosen.stage_time_s)
    with pytest.raises(ValueError, match="first layer, from 0 and rising"):
        price_stages(profile, [1], [4], 1e9)
    with pytest.raises(ValueError, match="one count of at least 1 per stage"):
        price_stages(profile, [0, 1], [3], 1e9)
