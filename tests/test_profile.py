"""Profiles: the profiler on Sequential and branchy fx models, PipeDream's graph.txt, JSON, the CLI."""
import functools
import json
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from handmade import MS, setup

import pipetrain
from pipetrain import cli
from pipetrain.layers import LayeredModel
from pipetrain.profiling import LayerProfile, Profile, ProfileError, as_minibatch, profile_model, time_batching

DATA = Path(pipetrain.__file__).parent / "data" / "pipedream"


def read_edges(path):
    """(node ids, edges) of a graph.txt, parsed here independently of pipetrain."""
    ids, edges = [], []
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            edges.append(tuple(line.strip().split(" -- ")))
        elif line.strip():
            ids.append(line.split(" -- ")[0])
    return ids, edges


@pytest.mark.parametrize("name, nodes, inputs", [("vgg16", 41, 1), ("alexnet", 23, 1), ("resnet18", 71, 1),
                                                 ("gnmt", 48, 3)])
def test_pipedream_files_read_in_topological_order(name, nodes, inputs):
    path = DATA / f"{name}.graph.txt"
    profile = Profile.load(path)
    ids, edges = read_edges(path)
    assert len(ids) == nodes and len(profile) == nodes - inputs  # Input nodes are not layers
    pos = {layer.name.split()[0]: k for k, layer in enumerate(profile.layers)}
    assert all(pos.get(a, -1) < pos[b] for a, b in edges)  # every edge points forward
    assert profile.model == name and profile.device.startswith("gpu")
    assert Profile.load(path) == profile  # deterministic
    # the bytes of cut k: every node at or before k (inputs count as before 0) feeding one after k
    sizes = {v: _activation(path, v) for v in ids}
    for k in range(len(profile) - 1):
        crossing = {a for a, b in edges if pos.get(a, -1) <= k < pos[b]}
        assert profile.layers[k].activation_bytes == sum(sizes[v] for v in crossing), k


def _activation(path, node):
    line = next(x for x in path.read_text().splitlines() if x.startswith(f"{node} -- "))
    value = re.search(r"activation_size=(\[[^\]]*\]|[^,]+)", line).group(1)
    return round(sum(float(x) for x in value.strip("[]").split(";")))


def test_vgg16_values():
    profile = Profile.load(DATA / "vgg16.graph.txt")
    first, last = profile.layers[0], profile.layers[-1]
    assert first.name.startswith("node2 Conv2d(3, 64")
    assert first.forward_s == pytest.approx(22.307e-3) and first.backward_s == pytest.approx(24.613e-3)
    assert first.activation_bytes == 1644167168 and first.parameter_bytes == 7168
    assert last.name.startswith("node41 Linear") and last.activation_bytes == 512000
    assert profile.input_bytes == 77070336


def node(name, desc, forward=1.0, backward=1.0, activation="1.0", parameters=1.0):
    return (f"{name} -- {desc} -- forward_compute_time={forward}, backward_compute_time={backward}, "
            f"activation_size={activation}, parameter_size={parameters}\n")


def test_list_activations_are_summed_and_branches_both_cross(tmp_path):
    # Shuffled lines; node3 returns two tensors; the cut after node4 carries node4's and node3's outputs.
    graph = tmp_path / "g.graph.txt"
    graph.write_text(node("node4", "Linear", 2.0, 3.0, "40.0", 8.0) + node("node1", "Input", 9.0, 0.0, "16.0", 0.0)
                     + node("node3", "LSTM", 1.0, 1.0, "[100.0; 20.0; 3.0]", 4.0)
                     + node("node10", "Add", 0.5, 0.5, "40.0", 0.0)
                     + "\tnode4 -- node10\n\tnode3 -- node4\n\tnode1 -- node3\n\tnode3 -- node10\n")
    profile = Profile.from_pipedream(graph, batch_size=8)
    assert [x.name for x in profile.layers] == ["node3 LSTM", "node4 Linear", "node10 Add"]
    assert [x.activation_bytes for x in profile.layers] == [123, 40 + 123, 40]
    assert profile.layers[0].compute_s == pytest.approx(2e-3) and profile.input_bytes == 16
    assert profile.batch_size == 8


@pytest.mark.parametrize("text, message", [
    (node("node1", "Conv", forward="x"), r":1: cannot read node line"),
    (node("node1", "Conv") + "\tnode1 -- node7\n", r":2: edge node1 -- node7 names a node with no node line"),
    (node("node1", "A") + node("node2", "B") + "\tnode1 -- node2\n\tnode2 -- node1\n",
     r": the edges form a cycle through node1, node2"),
    (node("node1", "Input"), r": no layer nodes found"),
    ("\n", r": the file is empty"),
    ('{"format": "something-else"}', r": not a pipetrain-profile version 1 file; make one with `pipetrain profile`"),
    ('{"format": "pipetrain-profile", "version": 1, "layers": [{"name": "a"}]}', r": malformed layer entry"),
    ("{not json", r": not valid JSON"),
])
def test_malformed_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    assert str(e.value).startswith(str(path)) and re.search(message, str(e.value)) and "\n" not in str(e.value)


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file; make one with `pipetrain profile"):
        Profile.load(tmp_path / "nope.json")


def test_json_round_trip(tmp_path):
    profile = Profile([LayerProfile("a", 0.1, 0.2, 64, 32), LayerProfile("b", 0.3, 0.4, 8, 0)], 16, "cpu", "M", 128)
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert json.loads(path.read_text())["layers"][1]["forward_s"] == 0.3


def test_building_a_minibatch_round_trips_scales_with_microbatches_and_must_be_a_time(tmp_path):
    profile = Profile([LayerProfile("a", 0.1, 0.2, 64, 32)], 16, "cpu", "M", 128, inputs_s=0.003, targets_s=0.001,
                      both_s=0.0035)
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    four = as_minibatch(profile, 4)
    assert (four.inputs_s, four.targets_s, four.both_s) == (pytest.approx(0.012), pytest.approx(0.004),
                                                            pytest.approx(0.014))
    assert (four.batch_size, four.meta["microbatches"], four.layers[0].forward_s) == (64, 4, pytest.approx(0.4))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "inputs_s": -1}))
    with pytest.raises(ProfileError, match="'inputs_s' is -1, not a finite number >= 0"):
        Profile.load(path)
    del data["both_s"]  # a profile saved before both_s: the two parts added up stand in
    path.write_text(json.dumps(data))
    assert Profile.load(path).building_s(0, 1) == pytest.approx(0.004)
    assert profile.building_s(0, 1) == 0.0035


def test_building_a_minibatch_is_timed_as_a_worker_builds_it():
    """Each part fetches every item (a worker building inputs or targets indexes the dataset itself)
    and collates that part, and building both fetches every item once: 3 items that each take at least
    2 ms to fetch take 6 ms or more each way."""
    fetched: list[int] = []

    class Slow(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int):
            fetched.append(i)
            time.sleep(0.002)
            return torch.full((2,), float(i)), torch.tensor(i)

    inputs_s, targets_s, both_s = time_batching(Slow(), 3, repeats=2)
    assert inputs_s >= 0.006 and targets_s >= 0.006 and both_s >= 0.006
    assert fetched == [0, 1, 2] * 9  # one untimed run and 2 timed, each of the three fetching every item once


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.BatchNorm1d(16), nn.Linear(16, 4))


class Residual(nn.Module):
    """x -> inp -> h; h -> a -> b -> y; out(y + h): the cuts inside the block carry h as well."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        y = self.b(torch.relu(self.a(h)))
        z = y + h
        return self.out(z.view(z.size(0), -1))


def test_profiler_on_sequential():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = pipetrain.profile(model, torch.randn(32, 8), repeats=3, warmup=1)
    assert len(profile) == 4 and [x.name for x in profile.layers] == ["0", "1", "2", "3"]
    assert [x.activation_bytes for x in profile.layers] == [32 * 16 * 4] * 3 + [32 * 4 * 4]
    assert [x.parameter_bytes for x in profile.layers] == [(8 * 16 + 16) * 4, 0, 32 * 4, (16 * 4 + 4) * 4]
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in profile.layers)
    assert (profile.batch_size, profile.device, profile.model, profile.input_bytes) == (32, "cpu", "Sequential", 1024)
    # profiling leaves the model as it was: batch-norm statistics restored, no gradients
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_profiler_with_loss_times_the_loss_on_the_last_layer():
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    profile = pipetrain.profile(mlp(), (x, y), nn.functional.cross_entropy, repeats=2, warmup=0)
    assert len(profile) == 4 and profile.layers[-1].backward_s > 0 and profile.batch_size == 16


def test_profiler_on_branchy_fx_model():
    model = Residual()
    layers = LayeredModel(model)
    profile = pipetrain.profile(model, torch.randn(5, 4), repeats=2, warmup=1)
    assert [x.name for x in profile.layers] == layers.names
    by_name = {x.name: x for x in profile.layers}
    one = 5 * 6 * 4  # bytes of one (5, 6) float32 tensor
    assert layers.crossing(layers.names.index("relu")) == ["inp", "relu"]
    assert by_name["relu"].activation_bytes == 2 * one  # both branches cross the residual cut
    assert by_name["add"].activation_bytes == one
    assert by_name["size"].activation_bytes == one  # the size is an int, not a tensor: no bytes
    assert by_name["out"].activation_bytes == 5 * 3 * 4
    assert by_name["inp"].parameter_bytes == (4 * 6 + 6) * 4 and by_name["add"].parameter_bytes == 0


def test_profiler_rejects_bad_input():
    with pytest.raises(ValueError, match="no tensors"):
        pipetrain.profile(mlp(), [1, 2])
    with pytest.raises(ValueError, match="repeats"):
        pipetrain.profile(mlp(), torch.randn(2, 8), repeats=0)
    with pytest.raises(ValueError, match=r"an \(input, target\) pair"):
        pipetrain.profile(mlp(), torch.randn(2, 8), nn.functional.cross_entropy)


def test_cli_profile_then_plan(capsys, tmp_path):
    out = tmp_path / "profile.json"
    code = cli.main(["profile", "pipetrain.zoo:digits_cnn", "--batch-size", "8", "--input-shape", "1,8,8",
                     "--repeats", "2", "--warmup", "0", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "profiled 9 layers of Sequential at batch 8 on cpu" in printed
    profile = Profile.load(out)
    assert len(profile) == 9 and profile.batch_size == 8
    code = cli.main(["plan", str(out), "--workers", "3", "--bandwidth", "1Gbit", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and sum(s["replicas"] for s in plan["stages"]) == 3
    assert plan["stages"][-1]["last_layer"] == 8
    code = cli.main(["profile", "pipetrain.zoo:digits_cnn", "--batch-size", "8", "--data", "pipetrain.data:digits",
                     "--loss", "cross_entropy", "--repeats", "1", "--warmup", "0", "-o", str(out)])
    with_data = Profile.load(out)
    assert code == 0 and with_data.input_bytes == 8 * 64 * 4 and with_data.inputs_s > 0 and with_data.targets_s > 0
    assert "ms its inputs" in capsys.readouterr().out


def test_a_microbatch_profile_stands_for_the_minibatch_its_microbatches_make():
    micro = Profile([LayerProfile("a", 1 * MS, 2 * MS, 100, 40, optimizer_s=0.5 * MS)], batch_size=16,
                    device="test", input_bytes=64, setup=setup())
    whole = as_minibatch(micro, 4)
    assert (whole.batch_size, whole.input_bytes, whole.setup) == (64, 256, micro.setup)
    layer = whole.layers[0]
    assert (layer.forward_s, layer.backward_s, layer.activation_bytes) == pytest.approx((4 * MS, 8 * MS, 400))
    assert (layer.parameter_bytes, layer.optimizer_s) == (40, 0.5 * MS)  # one optimizer step per minibatch
    assert whole.meta == {"measured_at_batch": 16, "microbatches": 4}


def test_profile_times_the_optimizer_and_leaves_the_model_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    adam = functools.partial(torch.optim.Adam, lr=0.1)
    measured = profile_model(model, batch, nn.functional.cross_entropy, optimizer=adam, repeats=3, warmup=2)
    assert [x.optimizer_s > 0 for x in measured.layers] == [True, False, True]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    measured.setup = setup()
    measured.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.setup == setup() and again.layers == measured.layers
    old = json.loads((tmp_path / "p.json").read_text())
    del old["setup"]
    for entry in old["layers"]:
        del entry["optimizer_s"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Profile.load(tmp_path / "old.json").layers[0].optimizer_s == 0.0


class Slow(nn.Module):
    """A layer that takes 50 ms and counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        time.sleep(0.05)
        return self.lin(x)


def test_a_slow_layer_runs_one_untimed_and_as_many_timed_as_its_time_allows():
    slow = Slow()
    model = nn.Sequential(nn.Linear(4, 4), slow)
    profile = profile_model(model, torch.randn(8, 4), repeats=5, warmup=2, layer_seconds=0.1)
    assert slow.calls == 2  # 7 runs of 50 ms exceed 0.1 s: one untimed, one timed
    assert profile.layers[1].forward_s >= 0.05
    profile_model(model, torch.randn(8, 4), repeats=5, warmup=2)
    assert slow.calls == 2 + 7  # no limit: warmup + repeats


def test_a_slow_layer_like_one_before_it_runs_no_untimed_run():
    first, second = Slow(), Slow()
    second.load_state_dict(first.state_dict())
    profile_model(nn.Sequential(first, second), torch.randn(8, 4), repeats=5, warmup=2, layer_seconds=0.1)
    assert (first.calls, second.calls) == (2, 1)  # the first warmed the second's kind up


def test_a_layer_whose_first_run_takes_longer_than_its_time_runs_once_and_is_timed():
    slow = Slow()
    profile = profile_model(nn.Sequential(nn.Linear(4, 4), slow), torch.randn(8, 4), repeats=5, warmup=2,
                            layer_seconds=0.02)
    assert slow.calls == 1 and profile.layers[1].forward_s >= 0.05


def test_with_a_time_per_layer_an_optimizer_step_on_the_same_shapes_is_timed_once():
    calls = []

    def sgd(params):
        opt = torch.optim.SGD(params, lr=0.1)
        calls.append(len(params))
        return opt

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    profile = profile_model(model, torch.randn(8, 4), optimizer=sgd, repeats=2, warmup=1, layer_seconds=10.0)
    assert len(calls) == 2 and profile.layers[1].optimizer_s == profile.layers[0].optimizer_s
    profile_model(model, torch.randn(8, 4), optimizer=sgd, repeats=2, warmup=1)
    assert len(calls) == 5  # without it, every layer's step is timed


class _Spy(nn.Linear):
    """A Linear that records whether its input asks for a gradient, each time it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[bool] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.asked.add(x.requires_grad)
        return super().forward(x)


def test_a_layer_computes_its_input_gradient_only_once_a_layer_before_it_trains():
    """As in a pipeline's input stage: after a Flatten the first Linear's backward never reaches the
    data, nor does a Linear's behind a frozen one; after a layer that trains, a Linear's input gradient
    is computed (a stage there sends it back). The first trained Linear's backward is all weights'."""
    first, second = _Spy(16, 8), _Spy(8, 4)
    model = nn.Sequential(nn.Flatten(), first, nn.ReLU(), second)
    profile = profile_model(model, (torch.randn(4, 4, 4), torch.randint(4, (4,))), nn.functional.cross_entropy,
                            repeats=2, warmup=0)
    assert first.asked == {False} and second.asked == {True}
    assert profile.layers[1].weight_backward_s == profile.layers[1].backward_s > 0
    frozen, after = _Spy(16, 8), _Spy(8, 4)
    frozen.requires_grad_(False)
    profile_model(nn.Sequential(frozen, after), (torch.randn(4, 16), torch.randint(4, (4,))),
                  nn.functional.cross_entropy, repeats=2, warmup=0)
    assert after.asked == {False}
