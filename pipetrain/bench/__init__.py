"""Benchmarks: an emulated cluster (network namespaces + tc) and peer runners to compare against.

``cluster``: :class:`EmulatedCluster`, hosts with rate-limited links on one Linux machine.
``peers``: job runners (pipetrain, PyTorch DDP, ``torch.distributed.pipelining``) measuring samples/s and bytes/sample.
``suite``: ``pipetrain bench`` (also ``python -m pipetrain.bench``), every system side by side on one model and link.
"""
