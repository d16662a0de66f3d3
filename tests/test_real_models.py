"""Models from Hugging Face transformers, cut by torch.export and by submodule name, checked against
plain SGD on the same model (skipped where transformers is not installed)."""
import copy
import functools

import pytest
import torch
from torch import nn

import pipetrain
from examples.gpt2_pipeline import data, lm_loss, model as gpt2
from pipetrain.layers import LayeredModel, LayerError, flatten

transformers = pytest.importorskip("transformers")
LR, BATCH = 0.05, 8


def bert(seed: int = 0) -> nn.Module:
    """A tiny BERT classifier (random init, no dropout), classifying the GPT-2 data's first token mod 3."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def bert_data(n: int = 64) -> torch.utils.data.TensorDataset:
    x, _ = data(n).tensors
    return torch.utils.data.TensorDataset(x, x[:, 0] % 3)


def bert_loss(output, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits, target)


CASES = {  # name: (model, dataset, loss, stages by name)
    "gpt2": (lambda: gpt2(layers=4, width=32, dropout=0.0), lambda: data(64), lm_loss,
             ["transformer.h.1", "transformer.h.3"]),
    "bert": (bert, bert_data, bert_loss, ["bert.encoder.layer.1", "bert.encoder.layer.2"]),
}


def plain_sgd(net: nn.Module, dataset, loss_fn, steps: int) -> nn.Module:
    """Minibatch SGD on the whole model, minibatch t = items [t*B, (t+1)*B), written here from the definition."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for t in range(steps):
        x, y = dataset[t * BATCH:(t + 1) * BATCH]
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return net


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CASES)
def test_model_parallel_on_exported_layers_is_plain_sgd(name: str) -> None:
    make, make_data, loss_fn, stages = CASES[name]
    net, dataset = make().double(), make_data()
    with pytest.raises(LayerError, match="cannot trace"):  # what made export necessary
        LayeredModel(net)
    result = pipetrain.train(net, dataset, loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                             stages=stages, schedule="model-parallel", batch_size=BATCH, shuffle=False, timeout=120)
    reference = plain_sgd(net, dataset, loss_fn, len(dataset) // BATCH)
    got, want = result.model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    assert any(not torch.equal(p, q) for p, q in zip(net.state_dict().values(), want.values()))  # it did train


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CASES)
def test_pipedream_trains_a_library_model(name: str) -> None:
    make, make_data, loss_fn, stages = CASES[name]
    result = pipetrain.train(make(), make_data(), loss_fn=loss_fn, stages=stages, batch_size=BATCH, epochs=3,
                             optimizer=functools.partial(torch.optim.Adam, lr=3e-3), timeout=120)
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4


def test_split_points_by_name_and_index_agree() -> None:
    net, (x, _) = gpt2(layers=4, width=32), data(8)[:]
    layers = LayeredModel(net, x)
    assert layers.captured_by == "export"
    at = layers.boundaries(["transformer.h.2"])[1]
    assert layers.paths[at].startswith("transformer.h.2") and not any(
        p.startswith("transformer.h.2") for p in layers.paths[:at])
    assert layers.boundaries([0, "transformer.h.2", at + 5]) == [0, at, at + 5]
    with pytest.raises(LayerError, match="no layer of GPT2LMHeadModel comes from a submodule named 'transformer.h.9'"):
        layers.boundaries(["transformer.h.9"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", pipetrain.OneFOneBFlush(microbatches=2)])
def test_tied_gpt2_flush_schedules_are_plain_sgd(schedule) -> None:
    net, dataset = gpt2(layers=2, width=32, dropout=0.0).double(), data(32)
    assert net.lm_head.weight is net.transformer.wte.weight
    result = pipetrain.train(net, dataset, loss_fn=lm_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                             stages=["transformer.h.1"], schedule=schedule, batch_size=BATCH, shuffle=False,
                             timeout=120)
    assert result.model.lm_head.weight is result.model.transformer.wte.weight
    want = plain_sgd(net, dataset, lm_loss, len(dataset) // BATCH).state_dict()
    got = result.model.state_dict()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["pipedream", "1f1b-flush", "gpipe"])
def test_tied_gpt2_trains_in_every_pipeline(schedule: str) -> None:
    result = pipetrain.train(gpt2(layers=2, width=32), data(64), loss_fn=lm_loss, stages=["transformer.h.1"],
                             schedule=schedule, batch_size=BATCH, epochs=3, timeout=120,
                             optimizer=functools.partial(torch.optim.Adam, lr=3e-3))
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
    assert torch.equal(result.model.lm_head.weight, result.model.transformer.wte.weight)


class Opaque(nn.Module):
    """Neither fx (control flow on a value) nor export (data-dependent branch on a tensor's value) takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if h.sum().item() > 0 else h


def test_a_model_neither_captures_names_both_failures() -> None:
    with pytest.raises(LayerError, match=r"cannot split Opaque: torch.fx cannot trace it \(.+\) and torch.export "
                                         r"cannot capture it \(.+\); pass an nn.Sequential"):
        LayeredModel(Opaque(), torch.randn(2, 4))


def test_profile_and_plan_work_on_exported_layers() -> None:
    """stages='auto' on a model only export captures: every operator profiled, then planned."""
    net, batch = gpt2(layers=2, width=32), data(8)[:]
    profile = pipetrain.profile(net, batch, lm_loss, repeats=1, warmup=0)
    labels = LayeredModel(net, batch[0]).labels
    assert [layer.name for layer in profile.layers] == labels and len(labels) > 50
    assert any(name.startswith("transformer.h.1.") for name in labels)
    chosen = pipetrain.plan(profile, 3, "10Mbit", straight=True)
    assert chosen.workers == 3 and chosen.num_layers == len(labels)


def test_every_cut_of_an_exported_model_carries_tensors_only() -> None:
    """Exported attention splits its projection into a list (q, k, v): a cut right after carries the
    list's tensors one by one, and the next stage rebuilds it."""
    net = gpt2(layers=2, width=32, dropout=0.0).double().eval()
    x = data(4)[:][0]
    layers = LayeredModel(net, x)
    want = net(x).logits
    for k in range(len(layers) - 1):
        head, tail = layers.stages([0, k + 1])
        cut = head(x)
        flatten(cut)  # tensors only, or it raises
        assert torch.equal(tail(cut).logits, want), layers.labels[k]


class BertItems(torch.utils.data.Dataset):
    """The BERT data as a Hugging Face dataset gives it: dictionaries of ``input_ids``, ``attention_mask``
    (item i's last i % 4 positions are padding) and ``labels``."""

    def __init__(self, n: int = 64) -> None:
        self.x, self.y = bert_data(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones_like(self.x[i])
        mask[len(mask) - i % 4:] = 0
        return {"input_ids": self.x[i], "attention_mask": mask, "labels": self.y[i]}


@pytest.mark.multiprocess
def test_bert_on_dictionary_items_splits_by_name_and_is_plain_sgd() -> None:
    """The attention mask enters the first stage by name and crosses the cut to the layers that use it."""
    net, dataset = bert().double(), BertItems()
    result = pipetrain.train(net, dataset, loss_fn=bert_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                             stages=["bert.encoder.layer.1"], schedule=pipetrain.GPipe(microbatches=2),
                             batch_size=BATCH, shuffle=False, timeout=120)
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for t in range(len(dataset) // BATCH):
        batch = torch.utils.data.default_collate([dataset[i] for i in range(t * BATCH, (t + 1) * BATCH)])
        opt.zero_grad()
        bert_loss(reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]),
                  batch["labels"]).backward()
        opt.step()
    got, want = result.model.state_dict(), reference.state_dict()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    assert any(not torch.equal(p, q) for p, q in zip(net.state_dict().values(), want.values()))  # it did train


def tokenizer(tmp_path) -> "transformers.BertTokenizerFast":
    """A word-level BERT tokenizer of the words w0..w39, made from a vocabulary file (nothing downloaded)."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(40)]) + "\n")
    return transformers.BertTokenizerFast(str(vocab))


@pytest.mark.multiprocess
def test_a_tokenized_dataset_and_data_collator_with_padding_train_a_bert_pipeline(tmp_path) -> None:
    """Items as a tokenizer gives them (lists of varying length, with ``label``: whether the text has 8
    words or more), padded to a fixed length by transformers' DataCollatorWithPadding (which renames
    ``label`` to ``labels``)."""
    tok = tokenizer(tmp_path)
    x, _ = data(64).tensors
    texts = [" ".join(f"w{int(t) % 40}" for t in row[:3 + i % 10]) for i, row in enumerate(x)]
    items = [{**tok(text), "label": int(len(text.split()) >= 8)} for text in texts]
    collate = transformers.DataCollatorWithPadding(tok, padding="max_length", max_length=16, return_tensors="pt")
    result = pipetrain.train(bert(), items, loss_fn=bert_loss, stages=["bert.encoder.layer.1"], batch_size=BATCH,
                             epochs=3, optimizer=functools.partial(torch.optim.Adam, lr=3e-3), collate_fn=collate,
                             timeout=120)
    losses = [h["loss"] for h in result.history]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
