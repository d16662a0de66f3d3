"""Zoo models: documented shapes, splittable into stages that compose back to the model, paper-like sizes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.layers import LayeredModel
from pipetrain.zoo import CHARS, MODELS, SPECS, char_lm_dataset, digits_cnn, lstm_lm, mnist_mlp, vgg_like

# Small knobs so the whole file runs in seconds on a shared 2-core machine.
SMALL = {
    "digits-cnn": {"width": 4},
    "vgg-like": {"widths": (4, 8, 8, 16), "hidden": 64},
    "alexnet-like": {"width": 4, "hidden": 32},
    "resnet-like": {"width": 4, "blocks": (1, 1)},
    "mnist-mlp": {"hidden": (16, 16)},
    "lstm-lm": {"embed": 8, "hidden": 16},
    "gpt-like": {"width": 16, "depth": 2, "heads": 2},
}


def test_models_keeps_the_demo_entry() -> None:
    assert MODELS["digits-cnn"] is digits_cnn
    assert set(MODELS) == set(SPECS) == set(SMALL)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_shapes_and_loss(name: str) -> None:
    spec = SPECS[name]
    x, y = spec.dataset(n=3, seed=1)[:]
    assert x.shape == (3, *spec.input_shape) and x.dtype == spec.input_dtype
    assert y.shape == (3, *spec.target_shape) and y.dtype == torch.long
    assert int(y.max()) < spec.classes
    out = spec.factory(**SMALL[name])(x)
    assert out.shape[:2] == (3, spec.classes)
    assert torch.isfinite(spec.loss_fn(out, y))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_split_stages_compose_to_the_model(name: str) -> None:
    torch.manual_seed(0)
    model = SPECS[name].factory(**SMALL[name]).eval()  # eval: BatchNorm must not update between the two runs
    layers = LayeredModel(model)
    assert len(layers) >= 4
    assert isinstance(model, nn.Sequential) != (name == "resnet-like")
    x, _ = SPECS[name].dataset(n=2)[:]
    n = len(layers)
    value = x
    for stage in layers.stages([0, n // 3, 2 * n // 3]):
        value = stage(value)
    torch.testing.assert_close(value, model(x))


def test_default_shapes_are_the_documented_ones() -> None:
    vgg = vgg_like()
    assert [m.in_features for m in vgg if isinstance(m, nn.Linear)] == [2048, 4096, 4096]
    assert vgg[-1].out_features == 10
    mlp = mnist_mlp()
    assert [(m.in_features, m.out_features) for m in mlp if isinstance(m, nn.Linear)] == \
        [(784, 500), (500, 500), (500, 10)]
    assert mlp(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_vgg_parameters_dwarf_the_activations_at_the_cut() -> None:
    """The PipeDream regime: weights to synchronise are far larger than what crosses the cut."""
    vgg = vgg_like()
    params = sum(p.numel() for p in vgg.parameters())
    fc = sum(p.numel() for m in vgg if isinstance(m, nn.Linear) for p in m.parameters())
    flatten = next(i for i, m in enumerate(vgg) if isinstance(m, nn.Flatten))
    with torch.no_grad():
        cut = LayeredModel(vgg).stage(0, flatten - 1)(torch.zeros(1, 3, 32, 32))
    assert cut.numel() == 2048
    assert fc > 0.9 * params
    # Per 32-sample minibatch, data parallelism syncs every gradient; a 2-stage pipeline cut before
    # Flatten sends activations forward and their gradients back: about 200x fewer bytes.
    assert params > 200 * (2 * cut.numel() * 32)


def test_vgg_rejects_an_image_the_pools_cannot_halve() -> None:
    with pytest.raises(ValueError, match="divisible"):
        vgg_like(image=8)
    assert vgg_like(in_channels=1, image=8, widths=(8, 16), hidden=32)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


def test_char_lm_dataset_is_shifted_text() -> None:
    ds = char_lm_dataset(seq_len=8, text="Hello, world!\tand more")
    x, y = ds[:]
    assert x.shape == y.shape == (2, 8)
    assert "".join(CHARS[i] for i in x[0]) == "Hello, w"
    assert torch.equal(x[0, 1:], y[0, :-1]) and torch.equal(y[0, -1:], x[1, :1])
    assert "?" in "".join(CHARS[i] for i in x.flatten())  # the tab is out of vocabulary
    assert len(char_lm_dataset()) > 100  # the bundled text is enough for a short run
    out = lstm_lm(embed=8, hidden=16)(x)
    assert out.shape == (2, len(CHARS), 8)
