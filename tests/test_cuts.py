"""Every cut the planner may choose runs, including one right before an operation that changes its input
in place (``ReLU(inplace=True)``, ``out += identity``): a stage runs on copies of what it receives and
sends back the gradient with respect to what it received."""
import copy
import functools

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.layers import LayeredModel, flatten, received, unflatten

BATCH, LR = 4, 0.1


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: one ReLU module used twice, in place, and an in-place residual."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
            out.add_(identity)  # what `out += identity` does; fx traces `+=` as `+`, but keeps add_
        else:
            out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A small torchvision-style ResNet for 8x8 images: stem, two stages of basic blocks, pool, classifier."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNet().double()


def images(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
                                          torch.randint(0, 3, (n,), generator=g))


def gradients(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in net.named_parameters()}


def before_in_place(layers: LayeredModel) -> list[int]:
    """The boundaries right before a layer that changes its first input in place (every ReLU here is
    in place)."""
    return [k for k, name in enumerate(layers.names) if k > 0 and ("relu" in name or name.startswith("add_"))]


def test_every_cut_of_a_resnet_with_in_place_operations_gives_the_whole_models_gradients() -> None:
    net = resnet()
    x, y = images(BATCH)[:]
    whole = copy.deepcopy(net)
    want_loss = nn.functional.cross_entropy(whole(x), y)
    want_loss.backward()
    layers = LayeredModel(net)
    assert len(before_in_place(layers)) >= 5  # the stem's ReLU, each block's ReLUs and residual adds
    for k in range(1, len(layers)):
        model = copy.deepcopy(net)
        head, tail = LayeredModel(model).stages([0, k])
        sent, is_tuple = flatten(head(x))
        # what the wire carries: the values, detached from the sender's graph
        leaves, fed = received([t.detach().clone() for t in sent], True)
        loss = nn.functional.cross_entropy(tail(unflatten(fed, is_tuple)), y)
        loss.backward()
        floats = [(s, leaf) for s, leaf in zip(sent, leaves) if s.is_floating_point() and s.requires_grad]
        torch.autograd.backward([s for s, _ in floats], [leaf.grad for _, leaf in floats])
        assert abs(loss.item() - want_loss.item()) < 1e-12, layers.labels[k]
        got = gradients(model)
        for name, want in gradients(whole).items():
            assert torch.allclose(got[name], want, rtol=0, atol=1e-9), (layers.labels[k], name)


def test_received_tensors_are_left_as_received_and_their_gradient_is_the_copies() -> None:
    t = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    leaves, fed = received([t], True)
    out = nn.ReLU(inplace=True)(fed[0])
    (out * torch.tensor([3.0, 5.0], dtype=torch.float64)).sum().backward()
    assert torch.equal(leaves[0], torch.tensor([-1.0, 2.0], dtype=torch.float64))
    assert torch.equal(leaves[0].grad, torch.tensor([0.0, 5.0], dtype=torch.float64))


@pytest.mark.multiprocess
def test_a_pipeline_cut_before_an_in_place_relu_trains_as_plain_sgd() -> None:
    net, dataset = resnet(), images(4 * BATCH)
    layers = LayeredModel(net)
    cut = next(k for k in before_in_place(layers) if layers.labels[k].startswith("layer1"))
    result = pipetrain.train(net, dataset, loss_fn=nn.functional.cross_entropy, stages=[0, cut],
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), schedule="model-parallel",
                             batch_size=BATCH, shuffle=False, timeout=120)
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for t in range(len(dataset) // BATCH):
        x, y = dataset[t * BATCH:(t + 1) * BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    got, want = result.model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key].double(), want[key].double(), rtol=0, atol=1e-9), key
    assert not torch.equal(net.fc.weight, want["fc.weight"])  # it did train
