"""What ``stages="auto"`` and ``strategy="auto"`` choose, and a whole ``strategy="auto"`` run."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from handmade import MS, setup

import pipetrain
from pipetrain.planning import Plan, plan
from pipetrain.planning.choose import choose_strategy
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import PipeDream
from pipetrain.strategies import ring


def test_auto_runs_the_partitioners_plan_against_one_stage_and_takes_the_faster(monkeypatch):
    """The partitioner's plan, here forced to two stages with 2 x 40 kB crossing a link of 10 ms per
    message, against both layers on both workers: simulated, one stage is faster and is taken."""
    import pipetrain.auto as auto
    from pipetrain.config import RunOptions, Training

    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 40_000, 100) for i in range(2)]
    slow_link = setup(cores=8, slowdown=1.0, latency_s=10 * MS, allreduce_latency_s=0.1 * MS, ring_s_per_byte=1e-9)
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=slow_link)
    asked: list[dict] = []
    monkeypatch.setattr(auto, "measured_profile", lambda *args, **kwargs: asked.append(kwargs) or profile)
    monkeypatch.setattr(auto, "propose", lambda p, w, b, **kw: plan(p, w, b, straight=True, **kw))
    data = TensorDataset(torch.zeros(64, 1), torch.zeros(64, 1))
    training = Training(model=nn.Linear(1, 1), dataset=data, loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=8)
    found = auto._plan_here(training, RunOptions(threads=1), PipeDream(), 2, "1Gbit")
    chosen = Plan.from_dict(found["plan"])
    simulated = chosen.options["simulated_samples_per_s"]
    assert chosen.config == "2" and set(simulated) == {"1-1", "2"}
    assert found["predicted"] == simulated["2"] > simulated["1-1"]
    assert asked == [{"ring_cpu": False}]  # a pipeline is not priced with our ring's CPU: not measured


def test_auto_runs_the_simulators_pick_of_the_plans_for_the_workers_asked(monkeypatch, capsys):
    """vgg16 on 64 workers at 10 Gbit/s: of the partitioner's plans for 64 (its paper model's
    33-1-1-1-1-27, and 42-1-1-1-1-18 from the model that adds each sync to its stage) the simulator takes
    the second; its plan for 43 workers (42-1) runs faster still, which ``stages="auto"`` says without
    taking it. (A memory limit, here one that every plan meets, leaves out the one stage on every worker
    that the pipeline is otherwise weighed against.)"""
    import pipetrain.auto as auto
    from pipetrain.config import RunOptions, Training
    from pipetrain.predict.pipeline import propose, simulate_steady
    from pipetrain.simulate import Link

    profile = Profile.load(Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt")
    monkeypatch.setattr(auto, "measured_profile", lambda *args, **kwargs: profile)
    data = TensorDataset(torch.zeros(64, 1), torch.zeros(64, 1))
    training = Training(model=nn.Linear(1, 1), dataset=data, loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=8)
    found = auto._plan_here(training, RunOptions(threads=1), PipeDream(), 64, "10Gbit", "1TiB")
    chosen = Plan.from_dict(found["plan"])
    assert chosen.config == "42-1-1-1-1-18" and plan(profile, 64, "10Gbit").config == "33-1-1-1-1-27"
    assert chosen.options["fewer_workers_faster"]["config"] == "42-1"
    proposed = propose(profile, 64, "10Gbit")
    plans = {p.config: p for p in [proposed, *proposed.alternatives]}
    rates = {config: simulate_steady(profile, plans[config], Link(), 8).minibatches_per_s
             for config in ("42-1", "42-1-1-1-1-18", "33-1-1-1-1-27")}
    assert rates["42-1"] > rates["42-1-1-1-1-18"] > rates["33-1-1-1-1-27"]
    monkeypatch.setattr(auto, "on_rank0", lambda fn, run: found)
    auto.plan_stages(training, RunOptions(threads=1), PipeDream(), 64, "10Gbit", {}, "1TiB")
    assert "a plan for 43 of the 64 workers (42-1) simulates faster" in capsys.readouterr().out


def test_strategy_auto_in_a_job_prices_the_plans_for_every_worker():
    """vgg16 on 64 workers at 10 Gbit/s, as the test above: ``pipetrain plan --strategies all`` takes the
    plan for 43 workers (42-1) that simulates faster; a job keeps its 64 (``every_worker``), so its
    pipeline runs 42-1-1-1-1-18 and its table names the faster plan for fewer."""
    profile = Profile.load(Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt")
    asked = dict(batch_size=64, strategies=["pipeline", "ddp"])
    shown = choose_strategy(profile, 64, "10Gbit", **asked).options["pipeline"]["stages"]
    kept = choose_strategy(profile, 64, "10Gbit", every_worker=True, **asked)
    chosen = kept.options["pipeline"]["stages"]
    assert (shown.config, shown.workers) == ("42-1", 43)
    assert (chosen.config, chosen.workers) == ("42-1-1-1-1-18", 64)
    assert chosen.options["fewer_workers_faster"]["config"] == "42-1"
    assert kept.predictions["pipeline"] < shown.samples_per_s
    assert "one for 43 workers (42-1) simulates faster" in kept.table()
    assert "plan 42-1 on 43 of the 64 workers" in choose_strategy(profile, 64, "10Gbit", **asked).table()


def heavy_weights() -> Profile:
    """Four layers with 25 MB of weights each and small activations: a pipeline's job at 100 Mbit/s."""
    layers = [LayerProfile(str(i), 10 * MS, 20 * MS, 4_000, 25_000_000) for i in range(4)]
    return Profile(layers, batch_size=32, device="test", input_bytes=4_000)


def light_weights() -> Profile:
    """Four layers of 4 KB weights and 40 MB activations: data parallelism's job."""
    layers = [LayerProfile(str(i), 10 * MS, 20 * MS, 40_000_000, 4_000) for i in range(4)]
    return Profile(layers, batch_size=32, device="test", input_bytes=40_000_000)


def test_auto_picks_a_pipeline_when_weights_are_heavy_and_the_link_slow():
    choice = choose_strategy(heavy_weights(), 4, "100Mbit")
    assert choice.choice == "pipeline"
    assert set(choice.predictions) == {"pipeline", "ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8"}
    assert "cgdp" in choice.skipped  # a link between workers: not one machine
    assert choice.predictions["pipeline"] > 2 * choice.predictions["ddp"]
    assert choice.reason.startswith("pipeline is predicted fastest for 4 workers at 100 Mbit/s")
    data = json.loads(json.dumps(choice.to_dict()))
    assert data["choice"] == "pipeline" and data["predictions"]["ddp"] == choice.predictions["ddp"]


def test_auto_prices_a_one_stage_plan_as_data_parallelism():
    choice = choose_strategy(light_weights(), 4, "10Gbit")
    assert choice.choice in ("ddp", "pipe-sgd")
    assert "pipeline" not in choice.predictions and "data parallelism" in choice.skipped["pipeline"]


def test_a_codec_is_predicted_but_picked_only_when_allowed(monkeypatch: pytest.MonkeyPatch):
    """Heavy weights, 2 workers: a pipeline of 2 stages still sends 50 MB per allreduce less than
    data parallelism, but quant8's ring sends a quarter of that. The ring's arithmetic is priced at a
    fixed 4 ns an element with a codec, 0.4 ns without (near what one thread takes): timed here, a
    busy machine could price quant8 out; whether a codec pays on a real machine is
    benchmarks/auto_pick.py's question."""
    monkeypatch.setattr(ring, "ring_compute_seconds",
                        lambda codec, elements, workers, *args, **kwargs: elements * (4e-9 if codec.lossy else 0.4e-9))
    profile = heavy_weights()
    refused = choose_strategy(profile, 2, "1Gbit", strategies=["ddp", "pipe-sgd", "pipe-sgd-quant8"])
    allowed = choose_strategy(profile, 2, "1Gbit", strategies=["ddp", "pipe-sgd", "pipe-sgd-quant8"],
                              allow_compression=True)
    assert refused.predictions["pipe-sgd-quant8"] > refused.predictions["pipe-sgd"]
    assert refused.choice == "pipe-sgd" and "allow_compression" in refused.skipped["pipe-sgd-quant8"]
    assert "pipe-sgd-quant8 would be" in refused.reason
    assert allowed.choice == "pipe-sgd-quant8"


def test_cgdp_competes_on_one_machine():
    choice = choose_strategy(light_weights(), 2, host_costs={"copy_s_per_byte": 1e-10, "sum_s_per_byte": 1e-10})
    assert "cgdp" in choice.predictions and choice.options["cgdp"]["chunk"] >= 1


def test_cgdp_takes_the_fewest_chunks_of_the_sizes_it_prices_alike():
    """Free copies, sums and signals price every chunk size of 4 layers alike; chunk size 3 makes the
    fewest chunks ([0, 1, 2] and [3]; 2 makes three, 1 and 4 four)."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10)
    choice = choose_strategy(profile, 2, host_costs={"copy_s_per_byte": 0.0, "sum_s_per_byte": 0.0},
                             strategies=["cgdp"])
    assert choice.options["cgdp"]["chunk"] == 3


def test_auto_refuses_what_it_would_choose_and_unknown_names():
    with pytest.raises(ValueError, match="unknown strategies"):
        choose_strategy(light_weights(), 2, strategies=["gpipe"])
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    with pytest.raises(ValueError, match="chooses stages itself"):
        pipetrain.train(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", workers=2,
                        stages=[0], batch_size=8)
    with pytest.raises(ValueError, match="needs workers"):
        pipetrain.train(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", batch_size=8)


@pytest.mark.multiprocess
def test_train_auto_measures_chooses_and_trains_the_choice(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    result = pipetrain.train(model, data, loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", workers=2,
                             batch_size=16, epochs=1, timeout=60)
    assert result.choice is not None and result.choice["choice"] in result.choice["predictions"]
    assert result.predicted_samples_per_s == result.choice["predictions"][result.choice["choice"]]
    assert len(result.history) == 4
    out = capsys.readouterr().out
    assert "strategy auto" in out and result.choice["reason"] in out
    assert "measured set-up: 2 workers x 1 threads" in out
