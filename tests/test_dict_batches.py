"""Datasets of dictionary items (Hugging Face style): the ``target_key`` entries are the target, the others
the model's keyword inputs; ``collate_fn`` builds minibatches. Checked in float64 against plain SGD
written here, and against the same run on the equivalent (input, target) pairs."""
import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import pipetrain
from pipetrain.batches import KeywordInputs, call, collate_parts, microbatch, to_device
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.errors import PipetrainError
from pipetrain.layers import LayeredModel, LayerError
from pipetrain.layout import Layout
from pipetrain.profiling import profile_model
from pipetrain.registry import as_schedule, as_strategy
from pipetrain.runtime.solo import run_stage_alone
from launching import ROOT

VOCAB, LENGTH, N, BATCH, LR = 11, 5, 32, 8, 0.1


class Tagger(nn.Module):
    """Embedding, a hidden layer, the mean over the unmasked positions, a classifier; fx traces it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 6)
        self.hidden = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        self.double()

    def forward(self, input_ids, attention_mask):
        h = torch.tanh(self.hidden(self.emb(input_ids)))
        mask = attention_mask.unsqueeze(-1)
        return self.out((h * mask).sum(1) / mask.sum(1))


class PairTagger(Tagger):
    """The same model taking its two inputs as one tuple, for a dataset of (input, target) pairs."""

    def forward(self, x):
        return super().forward(x[0], x[1])


def _tokens(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, the length each item uses (the rest is padding) and a class per item."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, VOCAB, (n, LENGTH), generator=g), torch.randint(2, LENGTH + 1, (n,), generator=g),
            torch.randint(0, 3, (n,), generator=g))


class Tokens(Dataset):
    """Dictionary items: ``input_ids``, ``attention_mask`` (float64), ``labels``, and with ``weighted`` a
    ``weight``."""

    def __init__(self, n: int = N, seed: int = 0, weighted: bool = False) -> None:
        self.ids, self.lengths, self.labels = _tokens(n, seed)
        self.weighted = weighted

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(LENGTH) < self.lengths[i]).double()
        item = {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.labels[i]}
        return {**item, "weight": 1.0 + self.lengths[i].double()} if self.weighted else item


def weighted_tokens() -> Tokens:
    return Tokens(weighted=True)


class TokenPairs(Tokens):
    """The same items as ((input_ids, attention_mask), labels) pairs."""

    def __getitem__(self, i: int):
        item = super().__getitem__(i)
        return (item["input_ids"], item["attention_mask"]), item["labels"]


class Unpadded(Tokens):
    """Items of varying length, without a mask: ``{"input_ids": ids[:length], "labels": ...}``."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :self.lengths[i]], "labels": self.labels[i]}


def pad(items: list[dict[str, torch.Tensor]], length: int | None = LENGTH) -> dict[str, torch.Tensor]:
    """A padding collate: ids padded with 0 to ``length`` (None: the minibatch's longest), and the mask."""
    width = length or max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.float64)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
        mask[row, :len(item["input_ids"])] = 1.0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([item["labels"] for item in items])}


pad_to_longest = functools.partial(pad, length=None)


def weighted_ce(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    labels, weight = target
    return (nn.functional.cross_entropy(out, labels, reduction="none") * weight).mean()


def plain_sgd(net: nn.Module, items: list[dict], loss_fn, epochs: int = 1, target=("labels",)) -> nn.Module:
    """Minibatch SGD on the whole model, minibatch t = items [t*B, (t+1)*B), written here from the definition."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(epochs):
        for t in range(len(items) // BATCH):
            batch = items[t * BATCH:(t + 1) * BATCH]
            inputs = {k: torch.stack([b[k] for b in batch]) for k in ("input_ids", "attention_mask")}
            y = [torch.stack([b[k] for b in batch]) for k in target]
            opt.zero_grad()
            loss_fn(net(**inputs), y[0] if len(y) == 1 else tuple(y)).backward()
            opt.step()
    return net


def run(dataset: Dataset, model: nn.Module | None = None, **kw) -> pipetrain.TrainResult:
    kw = {"loss_fn": nn.functional.cross_entropy, "optimizer": functools.partial(torch.optim.SGD, lr=LR),
          "batch_size": BATCH, "shuffle": False, "timeout": 60, **kw}
    return pipetrain.train(model or Tagger(), dataset, **kw)


def assert_same(got: nn.Module, want: nn.Module) -> None:
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys()
    for key in w:
        assert torch.allclose(g[key], w[key], rtol=0, atol=1e-9), key
    assert not torch.equal(w["out.weight"], Tagger().out.weight)  # it did train


def items(dataset: Dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [
    {"strategy": "ddp", "workers": 2},
    {"strategy": "cgdp", "workers": 2},
    {"strategy": pipetrain.PipeSGD(staleness=1), "workers": 2},
    {"stages": ["hidden"], "schedule": pipetrain.GPipe(microbatches=2)},
    {"stages": ["hidden"], "schedule": "1f1b-flush"},
    {"stages": ["hidden"], "schedule": "model-parallel"},
], ids=["ddp", "cgdp", "pipe-sgd", "gpipe", "1f1b-flush", "model-parallel"])
def test_keyword_inputs_train_as_plain_sgd(how: dict) -> None:
    result = run(Tokens(), **how)
    assert_same(result.model, plain_sgd(Tagger(), items(Tokens()), nn.functional.cross_entropy))


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["pipedream", "naive"])
def test_asynchronous_pipelines_match_the_same_run_on_pairs(schedule: str) -> None:
    """Weight stashing makes PipeDream differ from plain SGD: the same run on (input, target) pairs,
    cut before the same layer, is the reference."""
    got = run(Tokens(), stages=["hidden"], schedule=schedule, epochs=2)
    want = run(TokenPairs(), PairTagger(), stages=["hidden"], schedule=schedule, epochs=2)
    assert_same(got.model, want.model)


@pytest.mark.multiprocess
def test_target_key_tuple_and_evaluation() -> None:
    result = run(Tokens(weighted=True), stages=["hidden"], schedule=pipetrain.GPipe(microbatches=2),
                 target_key=("labels", "weight"), loss_fn=weighted_ce, eval_dataset=Tokens(16, seed=1, weighted=True))
    want = plain_sgd(Tagger(), items(Tokens(weighted=True)), weighted_ce, target=("labels", "weight"))
    assert_same(result.model, want)
    held_out = items(Tokens(16, seed=1, weighted=True))
    with torch.no_grad():
        losses = [weighted_ce(want(**{k: torch.stack([b[k] for b in held_out[t:t + BATCH]])
                                      for k in ("input_ids", "attention_mask")}),
                              tuple(torch.stack([b[k] for b in held_out[t:t + BATCH]]) for k in ("labels", "weight")))
                  for t in range(0, 16, BATCH)]
    assert result.history[-1]["eval"]["loss"] == pytest.approx(float(sum(losses)) / len(losses), abs=1e-9)


@pytest.mark.multiprocess
def test_a_padding_collate_fn_trains_variable_length_items() -> None:
    result = run(Unpadded(), stages=["hidden"], schedule="gpipe", collate_fn=pad, loader_workers=2)  # built ahead
    assert_same(result.model, plain_sgd(Tagger(), items(Tokens()), nn.functional.cross_entropy))
    # data parallelism takes minibatches of any shape (seed 1: minibatch 1 is shorter)
    ddp = run(Unpadded(seed=1), strategy="ddp", workers=2, collate_fn=pad_to_longest)
    reference = Tagger()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for t in range(N // BATCH):
        batch = pad_to_longest(items(Unpadded(seed=1))[t * BATCH:(t + 1) * BATCH])
        opt.zero_grad()
        nn.functional.cross_entropy(reference(batch["input_ids"], batch["attention_mask"]), batch["labels"]).backward()
        opt.step()
    assert_same(ddp.model, reference)


@pytest.mark.multiprocess
def test_padding_to_each_minibatchs_longest_is_one_line_in_a_pipeline() -> None:
    dataset = Unpadded(seed=1)
    assert [len(pad_to_longest(items(dataset)[t:t + BATCH])["input_ids"][0]) for t in (0, BATCH)] == [5, 4]
    with pytest.raises(PipetrainError) as e:
        run(dataset, stages=["hidden"], schedule="gpipe", collate_fn=pad_to_longest)
    message = str(e.value)
    assert "\n" not in message
    assert "minibatch 1's inputs have shape {'input_ids': (8, 4), 'attention_mask': (8, 4)} but the first " \
           "minibatch's had {'input_ids': (8, 5), 'attention_mask': (8, 5)}" in message
    assert "pad to one fixed length, e.g. padding='max_length'" in message


@pytest.mark.parametrize("key, message", [
    ("label", r"target_key 'label' is not in the dataset's items \(item 0 has keys 'input_ids', 'attention_mask', "
              r"'labels'\); pass target_key= naming"),
    (("labels", "weights"), r"target_key 'weights' is not in the dataset's items"),
    (3, r"target_key=3: name the dictionary entry that is the target"),
])
def test_a_bad_target_key_is_refused_before_any_worker_starts(key, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(Tokens(), strategy="ddp", workers=2, target_key=key)


def test_items_holding_only_the_target_and_a_sequential_on_keywords_are_refused() -> None:
    with pytest.raises(ValueError, match=r"hold only the target \('input_ids', 'labels'\)"):
        run(Unpadded(), strategy="ddp", workers=2, target_key=("input_ids", "labels"))
    with pytest.raises(LayerError, match="an nn.Sequential takes one input"):
        LayeredModel(nn.Sequential(nn.Linear(2, 2)), KeywordInputs(x=torch.zeros(1, 2)))


def test_collate_parts_splits_the_target_and_microbatches_slice_each_entry() -> None:
    inputs, target = collate_parts(Tokens(weighted=True), range(4), (0, 1), ("weight", "labels"))
    assert list(inputs) == ["input_ids", "attention_mask"]
    ids, _, labels = _tokens()
    assert torch.equal(inputs["input_ids"], ids[:4]) and torch.equal(target[1], labels[:4])
    half = microbatch(inputs, 1, 2)
    assert torch.equal(half["input_ids"], ids[2:4]) and half["attention_mask"].shape == (2, LENGTH)
    assert torch.equal(microbatch(target, 1, 2)[1], labels[2:4])
    assert isinstance(inputs, KeywordInputs) and isinstance(to_device(half, torch.device("cpu")), KeywordInputs)
    pairs = collate_parts(TokenPairs(), range(4), (0, 1))
    assert torch.equal(pairs[0][0], ids[:4]) and torch.equal(pairs[1], labels[:4])


class DictInput(Dataset):
    """(input, target) pairs whose input is a dict: the model still gets it as one argument."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return {"a": torch.tensor([float(i)])}, torch.tensor(0.0)


class SumOfA(nn.Module):
    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return x["a"].sum()


def test_a_pair_whose_input_is_a_dict_still_passes_it_positionally() -> None:
    inputs, _ = collate_parts(DictInput(), range(4), (0, 1))
    assert type(inputs) is dict and call(SumOfA(), inputs) == 6.0


class Shaped(Tagger):
    """Control flow on a shape: fx cannot trace it, so torch.export captures it with keyword inputs."""

    def forward(self, input_ids, attention_mask):
        if input_ids.shape[1] > 1:
            attention_mask = attention_mask * 1.0
        return super().forward(input_ids, attention_mask)


@pytest.mark.parametrize("model", [Tagger, Shaped])
def test_the_first_stage_takes_the_inputs_by_name(model) -> None:
    net = model()
    batch = collate_parts(Tokens(), range(BATCH), (0,))[0]
    layers = LayeredModel(net, batch)
    assert layers.captured_by == ("fx" if model is Tagger else "export")
    first, second = layers.stages(layers.boundaries(["hidden"]))
    reordered = KeywordInputs(attention_mask=batch["attention_mask"], input_ids=batch["input_ids"])
    assert torch.equal(call(second, call(first, reordered)), net(**batch))
    assert not layers.takes_tuple(0)


def test_profiler_and_solo_replay_take_keyword_inputs() -> None:
    batch = collate_parts(Tokens(), range(BATCH), (0, 1))
    profile = profile_model(Tagger(), tuple(batch), nn.functional.cross_entropy)
    assert len(profile.layers) == len(LayeredModel(Tagger())) and profile.batch_size == BATCH
    training = Training(model=Tagger(), dataset=Unpadded(), loss_fn=nn.functional.cross_entropy, batch_size=BATCH,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), shuffle=False, collate_fn=pad)
    strategy = as_strategy("pipeline")
    assert not isinstance(strategy, pipetrain.Auto)
    cfg = JobConfig(training, RunOptions(), strategy, as_schedule(pipetrain.GPipe(microbatches=2)),
                    Layout.pipeline([0, 3]))
    for stage in (0, 1):
        kinds = [r[0][0] for r in run_stage_alone(cfg, stage, 2)]
        assert kinds.count("F") == 4


@pytest.mark.multiprocess
def test_stages_auto_plans_a_model_of_keyword_inputs() -> None:
    result = run(Tokens(), stages="auto", workers=2, bandwidth="1Gbit")
    assert result.plan is not None and result.plan.workers == 2
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in result.history])))


@pytest.mark.multiprocess
def test_command_line_target_keys_and_collate_fn() -> None:
    job = ["train", "test_dict_batches:Tagger", "--data", "test_dict_batches:weighted_tokens", "--stages", "hidden",
           "--loss", "test_dict_batches:weighted_ce", "--batch-size", "8", "--collate-fn",
           "torch.utils.data:default_collate"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    for keys, code in (("labels, weight", 0), ("label", 1)):
        r = subprocess.run([sys.executable, "-m", "pipetrain.cli", *job, "--target-key", keys], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == code, r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert "target_key 'label' is not in the minibatches collate_fn builds from the dataset (item 0 has keys " \
           "'input_ids', 'attention_mask', 'labels', 'weight')" in r.stderr
