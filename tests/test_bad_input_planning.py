"""Bad input to profiling, planning and simulating: each is refused with one line naming what is wrong
and what to do, before anything runs (never a traceback, never a wrong result with exit code 0)."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain import cli
from pipetrain.planning import Plan, plan
from pipetrain.profiling import LayerProfile, Profile, ProfileError

VGG16 = Path(pipetrain.__file__).parent / "data" / "pipedream" / "vgg16.graph.txt"


def one_line(e: pytest.ExceptionInfo, *words: str) -> None:
    message = str(e.value)
    assert "\n" not in message, message
    for w in words:
        assert w in message, (w, message)


def run(capsys, *argv: str) -> str:
    """The stderr of a CLI call that must fail with exit code 1 and one line."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith(f"pipetrain {argv[0]}: error: "), err
    return err


@pytest.fixture
def profile_json(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    Profile([LayerProfile("a", 0.1, 0.2, 64, 32), LayerProfile("b", 0.3, 0.4, 8, 0)], 16, "cpu", "M", 128).save(path)
    return path


def edited(path: Path, **changes) -> Path:
    """The profile JSON at ``path`` with top-level fields changed (``layer_1`` edits layer 1)."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            data["layers"][int(key[6:])].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


# -- profile JSON -------------------------------------------------------------------------------------

def test_invalid_profile_json_names_the_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"format": oops}')
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, f"{path}: not valid JSON", "line 1 column 12", "make one with `pipetrain profile")
    assert "truncated" not in str(e.value)


def test_truncated_profile_json_says_truncated(profile_json):
    text = profile_json.read_text()
    profile_json.write_text(text[:len(text) // 2])
    with pytest.raises(ProfileError) as e:
        Profile.load(profile_json)
    one_line(e, f"{profile_json}: not valid JSON (truncated?)", "line ")


def test_cli_plan_of_a_truncated_profile_is_one_line(capsys, profile_json):
    profile_json.write_text(profile_json.read_text()[:100])
    err = run(capsys, "plan", profile_json, "--workers", "2")
    assert f"{profile_json}: not valid JSON (truncated?)" in err


@pytest.mark.parametrize("text", ["[1, 2]", '{"format": "pipetrain-plan", "version": 1}', '"profile"'])
def test_json_that_is_not_a_profile(tmp_path, text):
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, f"{path}: not a pipetrain-profile version 1 file; make one with `pipetrain profile`")


def test_profile_from_a_newer_pipetrain(profile_json):
    with pytest.raises(ProfileError) as e:
        Profile.load(edited(profile_json, version=2))
    one_line(e, "written by a newer pipetrain (pipetrain-profile version 2; this one reads 1)", "upgrade pipetrain")


@pytest.mark.parametrize("changes, words", [
    (dict(layer_1={"backward_s": None}), "layer entry 1 ('b'): 'backward_s' is None, not a number"),
    (dict(layer_0={"forward_s": "fast"}), "layer entry 0 ('a'): 'forward_s' is 'fast', not a number"),
    (dict(layer_0={"activation_bytes": 1.5}), "'activation_bytes' is 1.5, not an integer"),
    (dict(layer_0={"parameter_bytes": True}), "'parameter_bytes' is True, not an integer"),
    (dict(layer_1={"forward_s": -0.1}), "layer entry 1 ('b'): 'forward_s' is -0.1, not a finite number >= 0"),
    (dict(layer_0={"activation_bytes": -4}), "'activation_bytes' is -4, not a finite number >= 0"),
    (dict(layers=[]), "'layers' is [], not a non-empty list of layer entries"),
    (dict(layers=[3]), "layer entry 0: 3 is not an object"),
    (dict(batch_size=-1), "'batch_size' is -1, not a finite number >= 0"),
    (dict(device=None, batch_size="16"), "'batch_size' is '16', not an integer"),
    (dict(meta=[]), "'meta' is [], not an object"),
    (dict(layer_0={"forward_s": 0, "backward_s": 0}, layer_1={"forward_s": 0.0, "backward_s": 0}),
     "every layer takes 0 s, so any throughput would be infinite"),
])
def test_profile_fields_of_the_wrong_type_or_sign(profile_json, changes, words):
    with pytest.raises(ProfileError) as e:
        Profile.load(edited(profile_json, **changes))
    one_line(e, f"{profile_json}: malformed ", words, "regenerate it with `pipetrain profile`")


def test_a_layer_without_a_field(profile_json):
    data = json.loads(profile_json.read_text())
    del data["layers"][1]["activation_bytes"]
    with pytest.raises(ProfileError) as e:
        Profile.from_dict(data, "p.json")
    one_line(e, "p.json: malformed layer entry 1 ('b'): no 'activation_bytes'")


def test_nan_in_a_profile(profile_json):
    profile_json.write_text(profile_json.read_text().replace('"forward_s": 0.1', '"forward_s": NaN'))
    with pytest.raises(ProfileError) as e:
        Profile.load(profile_json)
    one_line(e, "'forward_s' is nan, not a finite number >= 0")


@pytest.mark.parametrize("name", ["profile.json", "graph.txt"])
def test_an_empty_profile_file(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n")
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, f"{path}: the file is empty; make one with `pipetrain profile")


# -- PipeDream graph.txt ------------------------------------------------------------------------------

def node(name: str, desc: str = "Conv", forward: object = 1.0, activation: object = "4.0",
         backward: float = 1.0) -> str:
    return (f"{name} -- {desc} -- forward_compute_time={forward}, backward_compute_time={backward}, "
            f"activation_size={activation}, parameter_size=8.0\n")


def graph(tmp_path, text: str) -> Path:
    path = tmp_path / "g.graph.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, words", [
    (node("node1") + "node2 -- Conv -- forward_compute_time=1.0\n" + node("node3") + "\tnode1 -- node3\n",
     ":2: cannot read node line 'node2 -- Conv"),
    (node("node1") + node("node2", activation="[1.0; 2") + "\tnode1 -- node2\n", ":2: cannot read node line"),
    (node("node1") + node("node2") + "\tnode1 -- node9\n\tnode1 -- node2\n",
     ":3: edge node1 -- node9 names a node with no node line"),
    (node("node1") + node("node2") + "\tnode1 node2\n\tnode1 -- node2\n", ":3: cannot read edge line 'node1 node2'"),
    (node("node1") + node("node2", forward=-1.0) + "\tnode1 -- node2\n",
     ":2: node node2 has forward_compute_time=-1.0; times and sizes must be finite and >= 0"),
    (node("node1") + node("node2") + node("node1", "Relu") + "\tnode1 -- node2\n",
     ":3: node node1 again (first at line 1)"),
])
def test_malformed_graph_lines_name_the_line(tmp_path, text, words):
    """Not on the last line, so with no hint that the file was cut short."""
    path = graph(tmp_path, text)
    with pytest.raises(ProfileError) as e:
        Profile.from_pipedream(path)
    one_line(e, f"{path}{words}")
    assert "truncated" not in str(e.value)


@pytest.mark.parametrize("cut", [
    lambda text: text[:text.index("node24 -- ReLU") + 20],  # in a node line, before the edges
    lambda text: text[:int(len(text) * 0.97)],  # in an edge line
    lambda text: text[:-3],  # in the last edge line
])
def test_a_truncated_graph_names_its_last_line(tmp_path, cut):
    text = cut(VGG16.read_text())
    path = graph(tmp_path, text)
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, f"{path}:{len(text.splitlines())}: ", "(the last line: truncated?)")


def test_a_graph_without_edges_is_refused(tmp_path, capsys):
    """Planned with every boundary free, it would look like a perfect pipeline."""
    nodes = "".join(line + "\n" for line in VGG16.read_text().splitlines() if not line.startswith("\t"))
    path = graph(tmp_path, nodes)
    with pytest.raises(ProfileError) as e:
        Profile.from_pipedream(path)
    one_line(e, f"{path}: has 41 nodes but no edges: the boundary costs would all be zero")
    assert "has 41 nodes but no edges" in run(capsys, "plan", path, "--workers", "4")
    text = VGG16.read_text()
    graph(tmp_path, text[:text.index("\n", text.index("node24 -- ReLU")) - 1])  # cut in a number: it parses
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, "has 23 nodes but no edges")
    assert len(Profile.load(graph(tmp_path, node("node1")))) == 1  # a single layer needs no edges


def test_a_graph_whose_layers_take_no_time(tmp_path, capsys):
    path = graph(tmp_path, node("node1", "Input") + node("node2", forward=0.0, backward=0.0)
                 + node("node3", forward=0.0, backward=0.0) + "\tnode1 -- node2\n\tnode2 -- node3\n")
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    one_line(e, f"{path}: every layer node takes 0 ms, so any throughput would be infinite")
    assert "every layer node takes 0 ms" in run(capsys, "simulate", path, "--stages", "0,1")


# -- pipetrain profile --------------------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    (["--batch-size", "0", "--input-shape", "1,8,8"], "--batch-size must be at least 1, got 0"),
    (["--batch-size", "4", "--input-shape", "1,x"], "--input-shape '1,x': give one sample's dimensions"),
    (["--batch-size", "4", "--input-shape", "1,8,0"], "--input-shape '1,8,0'"),
    (["--batch-size", "4", "--input-shape", "1,8,8", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--batch-size", "4", "--input-shape", "1,8,8", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
])
def test_cli_profile_options(capsys, tmp_path, options, words):
    out = tmp_path / "profile.json"
    assert words in run(capsys, "profile", "pipetrain.zoo:digits_cnn", *options, "-o", out)
    assert not out.exists()


def test_cli_profile_input_shape_spellings(capsys, tmp_path):
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "pipetrain.zoo:digits_cnn", "--batch-size", "2", "--input-shape", "1x8x8",
                     "--repeats", "1", "--warmup", "0", "-o", str(out)]) == 0
    assert Profile.load(out).batch_size == 2


def test_cli_profile_input_shape_takes_the_models_dtype(capsys, tmp_path):
    """A float64 model is profiled on float64 random input; input it cannot run on points to --data."""
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "pt_models:mlp", "--batch-size", "2", "--input-shape", "4", "--repeats", "1",
                     "--warmup", "0", "-o", str(out)]) == 0
    assert Profile.load(out).input_bytes == 2 * 4 * 8
    err = run(capsys, "profile", "pt_models:mlp", "--batch-size", "2", "--input-shape", "5", "-o", out)
    assert "does not run on random torch.float64 input of shape [2, 5]" in err
    assert err.rstrip().endswith("give real samples with --data MODULE:FACTORY")


def test_profiling_no_samples_is_refused():
    with pytest.raises(ValueError) as e:
        pipetrain.profile(nn.Sequential(nn.Linear(4, 2)), torch.randn(0, 4))
    one_line(e, "sample_batch holds 0 samples")


# -- pipetrain simulate -------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["pipeline", "ddp", "pipe-sgd", "cgdp"])
@pytest.mark.parametrize("option, value, words", [
    ("--minibatches", "0", "--minibatches must be at least 1, got 0"),
    ("--workers", "0", "--workers must be at least 1, got 0"),
    ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
    ("--latency", "-1", "--latency must be at least 0, got -1.0"),
    ("--update-s", "-0.5", "--update-s must be at least 0, got -0.5"),
])
def test_cli_simulate_counts_and_times(capsys, profile_json, strategy, option, value, words):
    workers = [] if option == "--workers" else ["--workers", "2"]
    assert words in run(capsys, "simulate", profile_json, "--strategy", strategy, *workers, option, value)


def test_cli_simulate_pipeline_options(capsys, profile_json):
    assert "--microbatches must be at least 1, got 0" in run(
        capsys, "simulate", profile_json, "--stages", "0,1", "--schedule", "gpipe", "--microbatches", "0")
    assert "--sync-latency must be at least 0" in run(
        capsys, "simulate", profile_json, "--strategy", "cgdp", "--workers", "2", "--sync-latency", "-1")
    assert "cannot read bandwidth '-1Gbit'" in run(capsys, "simulate", profile_json, "--workers", "2",
                                                   "--bandwidth=-1Gbit")


@pytest.mark.parametrize("strategy", ["ddp", "pipe-sgd", "cgdp"])
def test_cli_data_parallel_needs_a_batch_size(capsys, strategy):
    """PipeDream's files do not record it; samples/s would print as 0."""
    err = run(capsys, "simulate", VGG16, "--strategy", strategy, "--workers", "4")
    assert f"{VGG16} does not record its batch size" in err and "--batch-size B" in err


# -- plans --------------------------------------------------------------------------------------------

@pytest.fixture
def plan_json(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    plan(VGG16, 4).save(path)
    return path


@pytest.mark.parametrize("version", [2, 7])
def test_plan_from_a_newer_pipetrain(capsys, plan_json, version):
    data = {**json.loads(plan_json.read_text()), "version": version}
    with pytest.raises(ValueError) as e:
        Plan.from_dict(data, "p.json")
    one_line(e, f"p.json: written by a newer pipetrain (pipetrain-plan version {version}; this one reads 1)",
             "upgrade pipetrain or make it again with `pipetrain plan`")
    plan_json.write_text(json.dumps(data))
    assert "written by a newer pipetrain" in run(capsys, "simulate", VGG16, "--plan", plan_json)


def test_plan_of_an_unknown_version_or_format(plan_json):
    for change in ({"version": 0}, {"version": "1"}, {"format": "pipetrain-profile"}):
        with pytest.raises(ValueError) as e:
            Plan.from_dict({**json.loads(plan_json.read_text()), **change}, "p.json")
        one_line(e, "p.json: not a pipetrain-plan version 1 file")


def test_truncated_or_invalid_plan_json(capsys, plan_json):
    text = plan_json.read_text()
    plan_json.write_text(text[:len(text) // 2])
    with pytest.raises(ValueError) as e:
        Plan.load(plan_json)
    one_line(e, f"{plan_json}: not valid JSON (truncated?)", "make one with `pipetrain plan")
    assert f"{plan_json}: not valid JSON (truncated?)" in run(capsys, "simulate", VGG16, "--plan", plan_json)
    plan_json.write_text("stages: 0-23\n")
    with pytest.raises(ValueError) as e:
        Plan.load(plan_json)
    one_line(e, f"{plan_json}: not valid JSON: Expecting value")


def test_unreadable_plan_files(tmp_path):
    (tmp_path / "empty.json").write_text("  \n")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    for name, words in (("", "no such plan file"), ("none.json", "no such plan file"),
                        ("empty.json", "the file is empty"), ("binary.json", "cannot read it as text")):
        with pytest.raises(ValueError) as e:
            Plan.load(tmp_path / name)
        one_line(e, f"{tmp_path / name}: {words}", "make one with `pipetrain plan PROFILE --workers N -o")


def test_plan_for_a_model_of_other_layers(capsys, plan_json, profile_json):
    err = run(capsys, "simulate", profile_json, "--plan", plan_json)
    assert f"{plan_json}: made for a model of 40 layers but this model has 2" in err
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError) as e:  # before any worker starts
        pipetrain.train(model, data, loss_fn=nn.functional.cross_entropy, optimizer=torch.optim.SGD,
                        stages=plan_json, batch_size=4)
    one_line(e, f"{plan_json}: made for a model of 40 layers but this model has 3", "re-run `pipetrain profile`")


# -- pipetrain plan -----------------------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--workers", "-3"], "--workers must be at least 1, got -3"),
    (["--workers", "4", "--bandwidth=-1Gbit"], "cannot read bandwidth '-1Gbit'; write it like 10Gbit"),
    (["--workers", "4", "--bandwidth", "0Gbit"], "bandwidth '0Gbit' must be positive"),
    (["--workers", "4", "--memory", "0"], "memory '0' must be positive; write it like 16GiB"),
    (["--workers", "4", "--memory", "1GB/s"], "memory '1GB/s' is a rate, not a size"),
    (["--workers", "4", "--memory", "1B"], "no configuration of 40 layers on 4 workers fits within 1 B"),
    (["--workers", "4", "--workers-per-server", "0", "--intra-bandwidth", "1Gbit"],
     "--workers-per-server must be at least 1, got 0"),
    (["--workers", "4", "--workers-per-server", "2", "--intra-bandwidth", "0bit"], "intra_bandwidth '0bit' must be"),
    (["--workers", "4", "--strategies", "all"], "vgg16.graph.txt does not record its batch size (as PipeDream's "
     "graph.txt files do not), so samples/s are unknown; give it with --batch-size B"),
    (["--workers", "4", "--strategies", "all", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
])
def test_cli_plan_options(capsys, options, words):
    assert words in run(capsys, "plan", VGG16, *options)


def test_cli_plan_strategies_of_a_graph_take_the_batch_size_given(capsys):
    """A PipeDream graph's times are taken as measured at --batch-size: twice the batch, twice the
    samples/s of the same plan and of ddp."""
    def predictions(batch: int) -> dict[str, float]:
        assert cli.main(["plan", str(VGG16), "--workers", "4", "--bandwidth", "1Gbit", "--strategies", "pipeline,ddp",
                         "--batch-size", str(batch), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["choice"] == "pipeline"
        return out["predictions"]

    small, large = predictions(64), predictions(128)
    assert large["pipeline"] == pytest.approx(2 * small["pipeline"]) and large["ddp"] == pytest.approx(2 * small["ddp"])


def test_plan_api_names_the_argument():
    profile = Profile.load(VGG16)
    with pytest.raises(ValueError) as e:
        plan(profile, 4, memory=0)
    one_line(e, "memory 0 must be positive")
    with pytest.raises(ValueError) as e:
        plan(profile, 4, workers_per_server=2, intra_bandwidth="-1Gbit")
    one_line(e, "cannot read intra_bandwidth '-1Gbit'")
    with pytest.raises(ValueError) as e:
        plan(profile, 0)
    one_line(e, "workers must be a positive integer, got 0")
