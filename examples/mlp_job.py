"""A pipetrain job to launch with torchrun, on one machine or several.

One machine, 4 workers:     torchrun --nproc-per-node 4 examples/mlp_job.py [--strategy pipe-sgd]
Two machines, 2 workers each (run on both; --node-rank 0 on the first, 1 on the second):
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST0 --master-port 29500 examples/mlp_job.py

As a pipeline, worker r runs stage r; with ``--strategy ddp``, ``pipe-sgd`` or ``cgdp`` every worker holds the
whole model and takes its share of every minibatch.
"""
import argparse
import functools

import torch
from torch import nn

import pipetrain
from pipetrain.data import regression


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4)).double()


def data():
    return regression(512, 8, 4)


if __name__ == "__main__":
    import os
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="pipeline", help="pipeline, ddp, pipe-sgd or cgdp")
    strategy = parser.parse_args().strategy
    world = int(os.environ.get("WORLD_SIZE", "4"))
    layout = {"stages": [0, 2, 4, 6][:world]} if strategy == "pipeline" else {"workers": world}
    result = pipetrain.train(model(), data(), loss_fn=torch.nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05), strategy=strategy,
                             batch_size=16, epochs=2, shuffle=False, **layout)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"final loss {result.history[-1]['loss']:.6f} after {len(result.history)} steps, "
              f"{result.samples_per_s:.0f} samples/s")
        torch.save(result.model.state_dict(), os.environ.get("PIPETRAIN_EXAMPLE_OUT", "mlp_job.pt"))
