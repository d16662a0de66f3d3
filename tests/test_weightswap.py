"""call_with: a module run with other tensors in place of its own, as torch.func.functional_call runs it."""
import pytest
import torch
from torch import nn

from pipetrain.weightswap import call_with


class TiedLM(nn.Module):
    """An embedding whose weight the output layer shares, and a buffer the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))) * self.scale)


def test_other_weights_fill_every_alias_and_the_modules_own_come_back():
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.tensor([[1, 5, 7]])
    own = {k: p for k, p in model.named_parameters()}
    other = {k: torch.randn_like(p, requires_grad=True) for k, p in own.items()}
    out = call_with(model, other, (ids,))
    # the same computation written out with the other tensors, the embedding's also as the head
    e, m = other["embed.weight"], other
    expected = (torch.tanh(e[ids] @ m["mix.weight"].T + m["mix.bias"]) * 2.0) @ e.T
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert all(t.grad is not None for t in other.values())
    assert all(p.grad is None for p in own.values())
    assert dict(model.named_parameters()) == own and model.head.weight is model.embed.weight
    # a buffer by name, and the module called many times with the same names
    for scale in (3.0, 0.5):
        got = call_with(model, {**other, "scale": torch.tensor(scale)}, (ids,))
        assert torch.equal(got, torch.func.functional_call(model, {**other, "scale": torch.tensor(scale)}, (ids,)))
    assert float(model.scale) == 2.0


def test_a_forward_that_raises_leaves_the_module_as_it_was():
    model = nn.Sequential(nn.Linear(3, 2))
    before = dict(model.named_parameters())
    with pytest.raises(RuntimeError):
        call_with(model, {"0.weight": torch.zeros(2, 3)}, (torch.zeros(1, 5),))
    assert dict(model.named_parameters()) == before


def test_names_that_are_not_the_modules_go_through_functional_call():
    model = nn.Linear(3, 2)
    weights = {"weight": torch.ones(2, 3), "extra": torch.zeros(1)}
    x = torch.ones(1, 3)
    assert torch.equal(call_with(model, weights, (x,)), torch.func.functional_call(model, weights, (x,)))
