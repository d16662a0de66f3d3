"""Benchmarks: pipetrain beside its peers on an emulated cluster (network namespaces + tc).

``cluster``: :class:`EmulatedCluster`, hosts with rate-limited links on one Linux machine.
``load``: how much CPU other processes take while a benchmark measures, and waiting them out.
``measure``: what every job runner shares: :class:`PeerConfig`, timed windows, a job's summary.
``torch_peers``: PyTorch DDP, a parameter server and ``torch.distributed.pipelining`` as job runners.
``pipetrain_jobs``: a ``pipetrain.train`` job as a runner, and the cost of its ring allreduce alone.
``stages``: a model cut into stages as pipetrain cuts it, and each stage timed alone.
``systems``: the systems ``pipetrain bench`` compares and a run's :class:`SuiteConfig`.
``suite``: ``pipetrain bench`` (also ``python -m pipetrain.bench``): every system side by side.
``predictions``: what the suite predicts beside its runs (``strategy="auto"``, data parallelism).
``report``, ``plot``: the report's data, targets and text; its bar chart.
"""
