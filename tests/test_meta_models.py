"""Models built on the meta device: weights read per stage from a file, or initialized per module, trained
exactly, and saved stage by stage as ``save_pretrained`` writes them.

Each run starts from weights that an independent reference also starts from (the file's tensors, or
``pipetrain.materialize`` of the same meta model), and the trained weights are read back from what
``save=`` wrote, never from a gathered model (a meta model is not gathered).
"""
import copy
import functools

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import pipetrain
from pt_models import mlp
from test_runtime_exact import BATCH, LR, STAGES, dataset, plain, reference, stashed
from test_tied import TiedNet
from test_tied import dataset as tied_dataset
from test_tied import reference as tied_reference

ARGS = dict(loss_fn=nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR), batch_size=BATCH,
            epochs=1, shuffle=False, seed=0, timeout=60)


def on_meta(build, *args) -> nn.Module:
    with torch.device("meta"):
        return build(*args)


def linears(state: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The MLP's (weight, bias) per Linear from a state dict (its Linears are children 0, 2, 4, 6)."""
    return [(state[f"{i}.weight"], state[f"{i}.bias"]) for i in (0, 2, 4, 6)]


def assert_same(got, want) -> None:
    for (gw, gb), (ww, wb) in zip(got, want):
        torch.testing.assert_close(gw, ww, rtol=0, atol=1e-9)
        torch.testing.assert_close(gb, wb, rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def mlp_weights(tmp_path_factory) -> str:
    """The exactness MLP's initial weights (what ``reference`` starts from) as one safetensors file."""
    path = tmp_path_factory.mktemp("weights") / "mlp.safetensors"
    save_file(mlp().state_dict(), str(path))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, rule", [("pipedream", stashed), (pipetrain.GPipe(microbatches=2), plain),
                                            (pipetrain.OneFOneBFlush(microbatches=2), plain)], ids=str)
def test_a_meta_model_loads_its_stages_from_weights_and_trains_exactly(schedule, rule, mlp_weights, tmp_path):
    out = tmp_path / "trained.safetensors"
    result = pipetrain.train(on_meta(mlp), dataset(), stages=STAGES, schedule=schedule, weights=mlp_weights,
                             save=out, **ARGS)
    assert result.model is None and result.saved == str(out)  # never gathered: save wrote it
    assert_same(linears(load_file(str(out))), reference(rule))


@pytest.mark.multiprocess
def test_weights_replace_those_of_a_model_given_with_real_ones(mlp_weights):
    result = pipetrain.train(mlp(seed=5), dataset(), stages=STAGES, schedule="gpipe", weights=mlp_weights, **ARGS)
    assert_same(linears(result.model.state_dict()), reference(plain))  # gathered: it had real weights


@pytest.mark.multiprocess
def test_data_parallel_workers_each_load_the_whole_model_from_weights(mlp_weights, tmp_path):
    result = pipetrain.train(on_meta(mlp), dataset(), strategy="ddp", workers=2, weights=mlp_weights,
                             save=tmp_path / "out", **ARGS)
    assert result.model is None
    assert_same(linears(pipetrain_weights(tmp_path / "out")), reference(plain))


def pipetrain_weights(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained-style directory, read with safetensors from its index's shards."""
    import json
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        out.update(load_file(str(directory / shard)))
    assert sorted(out) == sorted(index)
    return out


@pytest.mark.multiprocess
def test_a_tied_head_left_out_of_the_file_is_read_under_its_tie(tmp_path):
    """As Hugging Face saves a tied ``lm_head.weight``: only the embedding is in the file; the last stage
    reads its copy of it under the embedding's name, and ``save`` writes it once, under that name."""
    state = {k: v for k, v in TiedNet().state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "tied.safetensors"))
    pipetrain.train(on_meta(TiedNet), tied_dataset(), loss_fn=nn.functional.cross_entropy,
                    optimizer=functools.partial(torch.optim.SGD, lr=0.2), stages=[0, 3, 5], schedule="pipedream",
                    batch_size=4, epochs=1, shuffle=False, timeout=60, weights=tmp_path / "tied.safetensors",
                    save=tmp_path / "out")
    got = pipetrain_weights(tmp_path / "out")
    assert "head.weight" not in got
    want = tied_reference(lambda s, t: max(0, t - 1 - (3 - s)), lambda t: max(0, t - 3))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-9)


def plain_sgd(model: nn.Module, epochs: int = 1) -> dict[str, torch.Tensor]:
    """Minibatch SGD on one process, as written in any training loop: the flush schedules' rule."""
    x_all, y_all = dataset().tensors
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(epochs):
        for t in range(len(x_all) // BATCH):
            opt.zero_grad()
            nn.functional.mse_loss(model(x_all[t * BATCH:(t + 1) * BATCH]), y_all[t * BATCH:(t + 1) * BATCH]).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages", [[0], [0, 4], [0, 2, 4, 6]], ids=lambda s: f"{len(s)} stages")
def test_initialization_does_not_depend_on_the_split(stages, tmp_path):
    """Without weights each worker initializes its own stage's tensors; one, two or four stages train the
    same model as plain SGD from ``materialize`` of the same meta model, in one process."""
    model = on_meta(mlp)
    want = plain_sgd(pipetrain.materialize(copy.deepcopy(model), seed=3))
    pipetrain.train(model, dataset(), stages=stages, schedule="gpipe", save=tmp_path / "out.safetensors",
                    **{**ARGS, "seed": 3})
    got = load_file(str(tmp_path / "out.safetensors"))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-9)


def test_materialize_is_seeded_by_the_job_seed_and_not_by_the_caller():
    a = pipetrain.materialize(on_meta(mlp), seed=3)
    torch.manual_seed(123)
    b = pipetrain.materialize(on_meta(mlp), seed=3)
    c = pipetrain.materialize(on_meta(mlp), seed=4)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert not torch.equal(a[0].weight, c[0].weight)


class Tokens(torch.utils.data.Dataset):
    """Dictionary items as a tokenizer gives them: ``input_ids`` and the next tokens as ``labels``."""

    def __init__(self, n: int = 32, length: int = 8) -> None:
        self.ids = torch.randint(0, 64, (n, length + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def lm_loss(out, labels):
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


@pytest.mark.multiprocess
def test_a_hugging_face_checkpoint_trains_on_four_stages_and_saves_back_for_from_pretrained(tmp_path):
    """save_pretrained -> a meta Llama loaded by pipetrain on 4 stages -> save -> from_pretrained gives the
    weights the same job trains from the model with real weights (gathered, the path the exactness
    tests cover), tied head included."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    args = dict(loss_fn=lm_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.5), batch_size=8, epochs=1,
                shuffle=False, timeout=120, schedule=pipetrain.OneFOneBFlush(microbatches=2),
                stages=["model.layers.1", "model.layers.2", "model.layers.3"])
    real = pipetrain.train(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), Tokens(), **args)
    meta = pipetrain.train(on_meta(LlamaForCausalLM, config), Tokens(), weights=tmp_path / "hf",
                           save=tmp_path / "trained", **args)
    assert [h["loss"] for h in meta.history] == [h["loss"] for h in real.history]
    back = LlamaForCausalLM.from_pretrained(tmp_path / "trained")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    want = real.model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    assert not torch.equal(want["model.norm.weight"], torch.ones(32))  # it trained


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_weights_that_do_not_fit_the_model_are_refused_before_any_worker_starts(tmp_path):
    state = mlp().state_dict()
    cases = {"missing": {k: v for k, v in state.items() if k != "4.bias"},
             "shape": {**state, "4.bias": torch.zeros(7, dtype=torch.float64)},
             "dtype": {**state, "4.bias": state["4.bias"].float()}}
    said = {"missing": r"has no tensor '4.bias'", "shape": r"'4.bias' has shape \(7,\) but the model's is \(6,\)",
            "dtype": r"'4.bias' is torch.float32 but the model's is torch.float64"}
    for case, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{case}.safetensors"))
        with pytest.raises(ValueError, match=said[case]) as e:
            pipetrain.train(on_meta(mlp), dataset(), stages=STAGES, weights=tmp_path / f"{case}.safetensors", **ARGS)
        assert f"{case}.safetensors" in one_line(e)
    with pytest.raises(ValueError, match="no such file or directory") as e:
        pipetrain.train(on_meta(mlp), dataset(), stages=STAGES, weights=tmp_path / "nowhere", **ARGS)
    one_line(e)


class Scaled(nn.Module):
    """A module whose parameter is set only in its ``__init__``: nothing can initialize it on a worker."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3, dtype=torch.float64)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_meta_model_that_cannot_be_initialized_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"the model \(Scaled\) sets its tensor 'scale' only in its __init__.*"
                                         r"pass weights=") as e:
        pipetrain.train(on_meta(Scaled), dataset(), stages=[0], **ARGS)
    one_line(e)


def test_a_meta_model_cannot_be_saved_as_a_gathered_state_dict(tmp_path):
    with pytest.raises(ValueError, match=r"save='.*model.pt' is a torch.save'd state dict of the model gathered") as e:
        pipetrain.train(on_meta(mlp), dataset(), stages=STAGES, save=tmp_path / "model.pt", **ARGS)
    one_line(e)


@pytest.mark.multiprocess
def test_evaluation_runs_an_exported_model_in_its_microbatches(tmp_path):
    """A stage torch.export captured is made for a microbatch's shapes: evaluation runs microbatch by
    microbatch too, and its loss is the mean over the held-out samples."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    result = pipetrain.train(model, Tokens(), eval_dataset=Tokens(16), loss_fn=lm_loss, timeout=120,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.0), batch_size=8, shuffle=False,
                             schedule=pipetrain.GPipe(microbatches=2), stages=["model.layers.1"])
    with torch.no_grad():
        batch = Tokens(16).ids
        want = sum(float(lm_loss(model(input_ids=batch[i:i + 8, :-1]), batch[i:i + 8, 1:])) for i in (0, 8)) / 2
    assert result.history[-1]["eval"]["loss"] == pytest.approx(want, abs=1e-6)
