"""Benchmarks: an emulated cluster (network namespaces + tc) and peer runners to compare against.

``cluster``: :class:`EmulatedCluster`, hosts with rate-limited links on one Linux machine.
``peers``: PyTorch DDP and ``torch.distributed.pipelining`` runners measuring samples/s and bytes/sample.
"""
