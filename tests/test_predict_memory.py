"""Each worker's predicted peak memory: the arithmetic against examples worked by hand, the partitioner's
memory limit against the same prediction, and predicted against measured on real runs."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import pipetrain
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.layout import Layout
from pipetrain.planning import plan
from pipetrain.predict.memory import predict_memory
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import DDP, GPipe, PipeDream, Pipeline, PipeSGD

BASELINE = 10_000


def profile() -> Profile:
    """Three layers at batch 8: a linear layer (1000 B of weights, 2000 B of optimizer state, 100 B out), an
    activation (200 B out), a linear layer (400 B, 800 B, 50 B out); 80 B of input; a process of 10 kB."""
    layers = [LayerProfile("0", 0.01, 0.02, 100, 1000, 0.001, trainable_bytes=1000, optimizer_bytes=2000),
              LayerProfile("1", 0.01, 0.02, 200, 0),
              LayerProfile("2", 0.01, 0.02, 50, 400, 0.001, trainable_bytes=400, optimizer_bytes=800)]
    return Profile(layers, batch_size=8, device="cpu", input_bytes=80, baseline_bytes=BASELINE)


def job(strategy=None, schedule=None, layout=None, recompute=False) -> JobConfig:
    """A job of 16 samples in minibatches of 8 on a model of three layers, as :func:`profile` has."""
    data = TensorDataset(torch.zeros(16, 2), torch.zeros(16, 2))
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    t = Training(model=model, dataset=data, loss_fn=nn.functional.mse_loss, batch_size=8, recompute=recompute,
                 optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return JobConfig(t, RunOptions(), strategy or Pipeline(), schedule, layout or Layout.pipeline([0, 2]))


def test_a_pipedream_pipeline_worked_by_hand():
    """Stage 0 (layers 0-1) holds 2 minibatches in flight, so 2 stashed versions beside its weights, and
    keeps its input and both outputs per minibatch (80 + 100 + 200 B); stage 1 holds 1, runs its live
    weights and keeps 200 + 50 B. Each adds its gradients, its optimizer state and the baseline."""
    stage0 = 1000 * (1 + 2) + 2 * (80 + 100 + 200) + 1000 + 2000 + BASELINE
    stage1 = 400 * (1 + 0) + 1 * (200 + 50) + 400 + 800 + BASELINE
    assert (stage0, stage1) == (16_760, 11_850)
    assert predict_memory(profile(), job(schedule=PipeDream())) == [stage0, stage1]


def test_microbatches_recomputation_and_replicas_worked_by_hand():
    # gpipe, 2 microbatches of 4 samples: both in flight at each stage (half a minibatch's bytes each), no
    # stashed version
    micro0, micro1 = (80 + 100 + 200) / 2, (200 + 50) / 2
    gpipe = [1000 + 2 * micro0 + 1000 + 2000 + BASELINE, 400 + 2 * micro1 + 400 + 800 + BASELINE]
    assert predict_memory(profile(), job(schedule=GPipe(microbatches=2))) == gpipe
    # recomputing: a microbatch in flight keeps its input, one holds its activations again while it reruns
    rerun0, rerun1 = 80 / 2 + micro0, 200 / 2 + micro1
    assert predict_memory(profile(), job(schedule=GPipe(microbatches=2), recompute=True)) == \
        [1000 + rerun0 + 1000 + 2000 + BASELINE, 400 + rerun1 + 400 + 800 + BASELINE]
    # stage 0 on 2 replicas: ceil(3 / 2) = 2 minibatches in flight on each, and its allreduce's flat copy of
    # its 1000 B of gradient
    replicated = 1000 * (1 + 2) + 2 * (80 + 100 + 200) + 1000 + 2000 + 1000 + BASELINE
    assert predict_memory(profile(), job(schedule=PipeDream(), layout=Layout.pipeline([0, 2], [2, 1]))) == \
        [replicated, replicated, 11_850]


def test_data_parallel_workers_worked_by_hand():
    """Each of 2 workers holds the whole model and one shard of 4 samples in flight: half the minibatch's
    input and outputs (80 + 100 + 200 + 50 B). DDP's buckets copy the gradient once, Pipe-SGD's K = 2
    buffers twice."""
    whole = 1400 + (80 + 100 + 200 + 50) / 2 + 1400 + 2800 + BASELINE
    assert predict_memory(profile(), job(DDP(), layout=Layout.data_parallel_on(2))) == [whole + 1400] * 2
    assert predict_memory(profile(), job(PipeSGD(staleness=2), layout=Layout.data_parallel_on(2))) == \
        [whole + 2 * 1400] * 2


def test_the_partitioners_memory_limit_is_the_predictions():
    """Every plan of the three layers on 2 workers priced by the prediction; at each of those needs (and 1 B
    below), the partitioner plans only what the prediction fits: at the least need the one plan that needs
    no more, below it none."""
    layouts = {"2": Layout.pipeline([0], [2]), "1-1 at 1": Layout.pipeline([0, 1]), "1-1 at 2": Layout.pipeline([0, 2])}
    need = {name: max(predict_memory(profile(), job(schedule=PipeDream(), layout=layout)))
            for name, layout in layouts.items()}
    assert need == {"2": 17_430, "1-1 at 1": 16_360, "1-1 at 2": 16_760}
    for limit in sorted({n - d for n in need.values() for d in (0, 1)}):
        fits = {name for name, n in need.items() if n <= limit}
        if not fits:
            with pytest.raises(ValueError, match="no configuration"):
                plan(profile(), 2, "100Gbit", memory=limit)
            continue
        chosen = plan(profile(), 2, "100Gbit", memory=limit)
        name = "2" if chosen.config == "2" else f"1-1 at {chosen.boundaries[1]}"
        assert name in fits, (limit, name)


def wide_mlp() -> nn.Sequential:
    """16 MB layers: the stages' weights, gradients and Adam state stand out of the process's baseline."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                         nn.ReLU(), nn.Linear(2048, 10))


@pytest.mark.multiprocess
def test_predicted_peak_memory_of_a_small_pipeline_is_near_the_measured():
    """A generous bound: the prediction leaves out an optimizer step's temporaries and the allocator's
    fragmentation (benchmarks/memory_prediction.py measures how far it is off, job by job)."""
    data = TensorDataset(torch.randn(256, 512), torch.randint(0, 10, (256,)))
    result = pipetrain.train(wide_mlp(), data, loss_fn=nn.functional.cross_entropy, stages=[0, 4], batch_size=64,
                             optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    assert result.peak_device_memory == [0, 0] and result.measured_memory == result.peak_memory
    assert len(result.predicted_memory) == 2 and result.phases["memory_s"] > 0
    for predicted, measured in zip(result.predicted_memory, result.measured_memory):
        assert abs(predicted / measured - 1) < 0.35, (result.predicted_memory, result.measured_memory)
    # stage 0 stashes 2 versions of its 21 MB of weights; stage 1, the output stage, none
    assert result.predicted_memory[0] - result.predicted_memory[1] > 2 * 21_000_000


class Tokens(Dataset):
    """Dictionary items of 16 token ids, the labels the ids themselves (a causal LM shifts them)."""

    def __init__(self, n: int = 32) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def next_token_loss(output, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.multiprocess
def test_stages_auto_plans_and_trains_a_llama_built_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.warns(pipetrain.PipetrainWarning, match="not gathered"):
        result = pipetrain.train(model, Tokens(), loss_fn=next_token_loss, stages="auto", workers=2, batch_size=8,
                                 optimizer=functools.partial(torch.optim.Adam, lr=1e-2), memory_limit="2GiB")
    assert result.model is None and all(t.is_meta for t in model.state_dict().values())
    assert result.plan is not None and result.plan.workers == 2 and len(result.history) == 4
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    assert len(result.predicted_memory) == 2 and max(result.predicted_memory) <= 2 * 2 ** 30
    assert "memory_s" not in result.phases  # the profile taken to plan serves the prediction


@pytest.mark.multiprocess
def test_strategy_auto_chooses_and_trains_on_a_model_built_on_the_meta_device():
    """Priced from a profile taken one layer at a time and a set-up whose step is one layer's; whichever
    strategy wins, its workers build their model or stage themselves."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    with pytest.warns(pipetrain.PipetrainWarning, match="not gathered"):
        result = pipetrain.train(model, data, loss_fn=nn.functional.cross_entropy, strategy="auto", workers=2,
                                 batch_size=16, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert result.choice is not None and len(result.history) == 8 and len(result.predicted_memory) == 2
    assert all(t.is_meta for t in model.state_dict().values())
