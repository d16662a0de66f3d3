"""Simulator vs real runs: does ``pipetrain.simulate`` predict what ``pipetrain.train`` measures?

Run it as ``python benchmarks/sim_vs_real.py [--quick | --smoke] [--json F] [--png-dir D]``.

On one CPU machine, one worker process per core: 2 stages on 2 cores. (3-4 stages would put several
single-threaded workers on one core; the simulator gives every worker a device of its own, so such a
prediction would be wrong by construction, and the script does not try.)

1. Profile (:mod:`simreal.predict`): a wide MLP (:func:`simreal.workload.wide_mlp`), layer by layer
   with ``pipetrain.profile``, in this one process with ``torch.set_num_threads(1)``, the thread
   count of every worker; at the minibatch size and at the microbatch size. CPU layer times are not
   linear in the batch while the simulator divides a stage's minibatch time by the microbatch count,
   so microbatched schedules get the microbatch profile scaled up by exactly that count
   (:func:`pipetrain.profiling.as_minibatch`). Each profile carries the run set-up of its size
   (:func:`pipetrain.setup.measure_setup` of two workers whose shared work is the model's training
   step), as ``stages="auto"`` measures it. The optimizer step (SGD + ``zero_grad``) is timed per stage
   and printed beside the profile's. The stage cut is the one that balances the profile.
2. Link (:mod:`simreal.link`): a ping-pong through the runtime's own ``Transport`` (gloo on loopback)
   between two otherwise idle processes; one way = round trip / 2; latency = a 4 KB message's one-way
   time, bandwidth from the cut-sized one. Also timed with both cores computing, and the CPU a
   message costs.
3. Real runs (:mod:`simreal.runs`): ``pipetrain.train`` with ``trace=True`` for ``pipedream``,
   ``gpipe`` and ``1f1b-flush`` (4 microbatches) and ``model-parallel``; samples/s = median of the
   output stage's per-step rate (``result.history``) without the first ``skip`` steps (fill,
   warm-up) and the last ``tail`` (drain); the median over ``reps`` runs, schedules interleaved.
4. Prediction (A) (:mod:`simreal.predict`): ``pipetrain.simulate`` of the same action lists with that
   profile and link; the same statistic taken from the simulated trace. The layer profiles and their
   set-ups are taken again before each later repetition's runs, and (A) is the median over them, as
   the measurement is the median over the runs. Printed beside the measurement with the error.
5. Diagnosis (:mod:`simreal.diagnose`). (B) the same simulation fed each stage's worker replayed alone
   in a fresh worker process by ``pipetrain.runtime.solo.run_stage_alone`` (the job's own worker,
   receives instant): what the runtime's code costs beyond the layers. (C) the simulator fed the real
   run's own mean action times and message delivery time: a check of its rules, not a prediction.
   Then ms per optimizer step per worker and action kind, real vs simulated; CPU time and page faults
   per step per worker; and the CPU-time slowdown of one stage while the other computes in another
   process.
6. Cost of tracing: ``pipedream`` with ``trace=False`` and ``trace=True`` alternating, median
   samples/s of each; one trace record timed directly in a tight loop of the runtime's record code.

Tables, PNGs and JSON: :mod:`simreal.report`; the order of it all: :mod:`simreal.main`. Other
people's processes share the machine: see [Note: foreign load] in ``pipetrain/bench/load.py``. Run it
under the benchmark lock others use (``flock /tmp/pipetrain-bench.lock python
benchmarks/sim_vs_real.py``). Results and their explanation: BENCHMARKS.md, "Simulator vs real runs".
"""
