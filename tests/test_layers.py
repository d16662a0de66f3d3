"""From a model to layers and stages: Sequential children, fx nodes, cuts carrying several tensors."""
import pytest
import torch

from pipetrain.layers import LayeredModel, LayerError, check_boundaries, flatten
from pt_models import Residual, Untraceable, mlp


def run_stages(model, boundaries, x):
    layers = LayeredModel(model)
    for stage in layers.stages(boundaries):
        x = stage(x)
    return x


def test_sequential_children_are_layers_and_keep_their_names():
    model = mlp()
    layers = LayeredModel(model)
    assert len(layers) == 7
    stages = list(layers.stages([0, 2, 4, 6]))
    assert list(stages[1].state_dict()) == ["2.weight", "2.bias"]
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(run_stages(model, [0, 2, 4, 6], x), model(x))


def test_fx_graph_is_linearized_and_cuts_carry_every_live_tensor():
    model = Residual().double()
    layers = LayeredModel(model)
    assert layers.names == ["inp", "tanh", "a", "tanh_1", "b", "add", "out"]
    assert layers.crossing(1) == ["tanh"]
    assert layers.crossing(3) == ["tanh", "tanh_1"]  # inside the residual block: both branches
    x = torch.randn(5, 4, dtype=torch.float64)
    mid = layers.stage(0, 3)(x)
    assert isinstance(mid, tuple) and len(mid) == 2
    for b in ([0, 2, 4], [0, 1, 2, 3, 4, 5, 6], [0]):
        torch.testing.assert_close(run_stages(model, b, x), model(x))


def test_stage_state_dicts_partition_the_model():
    model = Residual()
    keys = [k for s in LayeredModel(model).stages([0, 3, 5]) for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())


def test_untraceable_model_error():
    with pytest.raises(LayerError, match="cannot trace Untraceable with torch.fx .*pass an nn.Sequential"):
        LayeredModel(Untraceable())


def test_boundary_checks():
    check_boundaries([0, 3], 5)
    for bad in ([], [1], [0, 0], [0, 5], [0, 1, 2, 3, 4, 5]):
        with pytest.raises(LayerError):
            check_boundaries(bad, 5)


def test_non_tensor_cut_is_refused():
    with pytest.raises(LayerError, match="carries a int"):
        flatten(3)
    assert flatten((torch.ones(1), torch.zeros(2)))[1] is True
