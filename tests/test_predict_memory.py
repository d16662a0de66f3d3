"""Each worker's predicted peak memory: a stage's bytes read off its shapes, the arithmetic against examples
worked by hand, and predicted against measured on real runs."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import pipetrain
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.layout import Layout
from pipetrain.layers import LayeredModel
from pipetrain.predict.memory import StageBytes, optimizer_ratio, stage_bytes, worker_bytes
from pipetrain.registry import DDP, GPipe, PipeDream, Pipeline, PipeSGD

BASELINE = 10_000


def job(strategy=None, schedule=None, layout=None, recompute=False, optimizer=torch.optim.SGD) -> JobConfig:
    """A job of 16 samples in minibatches of 8 on Linear(2, 4), ReLU, Linear(4, 2) in float32."""
    data = TensorDataset(torch.zeros(16, 2), torch.zeros(16, 2))
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    t = Training(model=model, dataset=data, loss_fn=nn.functional.mse_loss, batch_size=8, recompute=recompute,
                 optimizer=functools.partial(optimizer, lr=0.1))
    return JobConfig(t, RunOptions(), strategy or Pipeline(), schedule, layout or Layout.pipeline([0, 2]))


def test_a_stages_bytes_are_read_off_its_shapes_as_autograd_saves_them():
    """Stage 0 (Linear(2, 4), ReLU) on 8 rows: the Linear saves its input (8 x 2 floats, 64 B), the ReLU its
    output (8 x 4, 128 B); weights 2 x 4 + 4 floats. Stage 1 (Linear(4, 2) and the loss) receives 128 B,
    runs on a copy of it, which the Linear saves (128 B), and the loss saves its output and target (64 B
    each). A data-parallel worker's shard of 4 rows: input 32 B, the ReLU's output 64 B (which the second
    Linear saves too), the loss's two 32 B."""
    cfg = job(schedule=PipeDream())
    layers = LayeredModel(cfg.training.model)
    assert stage_bytes(cfg, layers) == {0: StageBytes(48, 48, 64 + 128, 0), 1: StageBytes(40, 40, 128 + 128 + 128, 128)}
    assert stage_bytes(job(DDP(), layout=Layout.data_parallel_on(2)), None) == {0: StageBytes(88, 88, 160, 0)}


STAGES = {0: StageBytes(1000, 1000, 300, 0), 1: StageBytes(400, 400, 250, 100)}


def test_a_pipedream_pipeline_worked_by_hand():
    """Stage 0 holds 2 minibatches in flight, so 2 stashed versions beside its weights, their stashes and one
    more (a running backward's), gradients and optimizer state (SGD with momentum: one buffer); stage 1
    holds 1 and runs its live weights."""
    stage0 = 1000 * (1 + 2) + (2 + 1) * 300 + 1000 + 1000 + BASELINE
    stage1 = 400 + (1 + 1) * 250 + 400 + 400 + BASELINE
    assert worker_bytes(job(schedule=PipeDream()), STAGES, 1.0, BASELINE) == [stage0, stage1]


def test_microbatches_recomputation_and_replicas_worked_by_hand():
    # gpipe, 2 microbatches: both in flight at each stage, no stashed version, SGD without state
    assert worker_bytes(job(schedule=GPipe(microbatches=2)), STAGES, 0.0, 0) == \
        [1000 + 3 * 300 + 1000, 400 + 3 * 250 + 400]
    # recomputing: a microbatch in flight keeps its input, the one whose backward runs its stash again
    assert worker_bytes(job(schedule=GPipe(microbatches=2), recompute=True), STAGES, 0.0, 0) == \
        [1000 + (0 + 300) + 300 + 1000, 400 + (100 + 250) + 250 + 400]
    # stage 0 on 2 replicas: ceil(3 / 2) = 2 minibatches in flight on each, and its allreduce's flat copy of
    # its gradient
    replicated = 1000 * (1 + 2) + 3 * 300 + 1000 + 1000
    assert worker_bytes(job(schedule=PipeDream(), layout=Layout.pipeline([0, 2], [2, 1])), STAGES, 0.0, 0) == \
        [replicated, replicated, 400 + 2 * 250 + 400]


def test_data_parallel_workers_worked_by_hand():
    """Each worker holds the whole model and its shard in flight; DDP's buckets copy the gradient once,
    Pipe-SGD's K = 2 buffers twice; Adam keeps two moments."""
    whole = {0: StageBytes(1400, 1400, 400, 0)}
    base = 1400 + 2 * 400 + 1400 + 2 * 1400
    assert worker_bytes(job(DDP(), layout=Layout.data_parallel_on(2)), whole, 2.0, 0) == [base + 1400] * 2
    assert worker_bytes(job(PipeSGD(staleness=2), layout=Layout.data_parallel_on(2)), whole, 2.0, 0) == \
        [base + 2 * 1400] * 2


def test_the_optimizers_state_per_trainable_byte():
    assert optimizer_ratio(functools.partial(torch.optim.SGD, lr=0.1)) == 0
    assert optimizer_ratio(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)) == 1
    assert optimizer_ratio(functools.partial(torch.optim.Adam, lr=0.1)) == 2


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
    assert result.phases["memory_s"] < 5  # read off the shapes on the meta device, nothing run


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
