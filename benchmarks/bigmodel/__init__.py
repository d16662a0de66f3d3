"""The parts of ``benchmarks/big_model.py``: ``model`` (the sizes, the meta model, its checkpoint and
data), ``ours`` (pipetrain's run and the loss check of what it saved), ``torch_recipe``
(torch.distributed.pipelining's manual split), ``report`` (tables and verdict), ``main`` (the command
line)."""
