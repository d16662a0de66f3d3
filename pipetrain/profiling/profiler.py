"""The profiler: times every layer of a model on one minibatch (:func:`profile_model`) and a dataset's
minibatch building (:func:`time_batching`), and turns a microbatch's profile into a minibatch's
(:func:`as_minibatch`)."""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pipetrain.batches import DEFAULT_TARGET_KEY, TargetKey, call, collate_parts, map_tensors, tensor_bytes, tensors_of
from pipetrain.streams import head
from pipetrain.layers import LayeredModel
from pipetrain.profiling.profile import LayerProfile, Profile
from pipetrain.runtime.compiled import compile_stage
from pipetrain.runtime.parts import Source, layer_stage
from pipetrain.stagecode import CodeStage


def profile_model(model: nn.Module, sample_batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  *, optimizer: Callable[..., torch.optim.Optimizer] | None = None, repeats: int = 10,
                  warmup: int = 2, layer_seconds: float | None = None, weights: str | None = None,
                  seed: int = 0, compile: bool = False) -> Profile:
    """Measure every layer of ``model`` on one minibatch.

    Layer k runs alone, as ``LayeredModel(model).stage(k, k)``, on what layer k - 1 returned, so its
    times are what a stage holding it would spend. Times are medians of ``repeats`` runs after
    ``warmup`` runs. A layer's backward is seeded with ones for each output (or, for the last layer,
    starts from ``loss_fn``) and computes the gradients of its parameters and, once a layer before it
    trains, of its inputs, as a pipeline stage must send those back (before that, as in the input stage,
    no backward reaches them: a ``Flatten`` then the first ``Linear`` never compute the data's gradient).
    Its ``weight_backward_s`` is that backward less one of the inputs' gradients alone (all of it where
    no input gradient is computed, none for a layer without parameters):
    what a split backward (``zero-bubble``'s ``W``) leaves for later. The model's buffers (e.g. batch-norm
    statistics) are restored afterwards and no ``.grad`` is touched.

    [Note: one layer at a time] The layers run on the device of ``sample_batch``. Where the model's
    tensors are there, each layer runs on them. Otherwise (a model built on the meta device, or one
    on the CPU profiled on a GPU) each layer's stage is built there alone, as a worker builds its
    stage (:func:`pipetrain.runtime.parts.layer_stage`: its tensors read from ``weights`` or
    initialized by :mod:`pipetrain.initialize` from ``seed``, or copied), timed, and let go before
    the next: the model is never whole in memory, which holds about its largest layer's tensors and
    the activations. The values do not matter to the times or bytes measured.

    Args:
        model: an ``nn.Sequential``, or a module ``torch.fx`` traces or ``torch.export`` captures (on
            this minibatch), on the device to profile.
        sample_batch: one minibatch of model input (a tensor, a tuple for several inputs, or a dict of
            keyword inputs); with ``loss_fn``, an ``(input, target)`` pair of a minibatch.
        loss_fn: ``loss_fn(output, target)``, timed as part of the last layer.
        optimizer: the training's optimizer factory (e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``):
            each layer's ``optimizer_s`` is one step of it on the layer's parameters (after
            ``warmup`` steps, which create its state), its ``optimizer_bytes`` that state's bytes; the
            parameters are restored afterwards.
        repeats: timed runs per layer.
        warmup: untimed runs per layer before those.
        layer_seconds: a layer (or optimizer step) whose first run shows that ``warmup + repeats`` runs
            would take longer runs fewer: one untimed and as many timed as fit (at least one), or, if
            the first run alone took longer, just that one, timed. A large model's layers take long
            enough that their median needs few runs. A slow layer like one before it (a transformer's
            blocks) runs no untimed run: the earlier one warmed it up, and its optimizer step, on
            parameters of the same shapes, is that one's. None: every layer runs ``warmup + repeats``
            times.
        weights: where a layer built on its own reads its tensors (``pipetrain.train``'s ``weights``);
            None: they are initialized.
        seed: the seed of that initialization.
        compile: time each layer compiled (``train(compile=True)``): its stage runs through
            ``torch.compile`` (:func:`pipetrain.runtime.compiled.compile_stage`), and one run before the
            warm-up ones, which compiles its forward and backward, is timed apart: the profile's
            ``meta["compile_s"]`` adds those up, never a layer's step times. A compiled layer's backward
            computes its inputs' and weights' gradients in one graph, so its ``weight_backward_s`` is
            about 0 (what the compiled split backward defers, see
            :func:`pipetrain.runtime.split_backward.fused_backward`).

    Returns:
        The profile, at the batch size and on the device of the input.

    Raises:
        LayerError: the model cannot be cut into layers.
        ValueError: ``repeats < 1``, no input tensors or samples, or no ``(input, target)`` pair with ``loss_fn``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if loss_fn is not None and not (isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2):
        raise ValueError("with loss_fn, sample_batch must be an (input, target) pair")
    value, target = sample_batch if loss_fn is not None else (sample_batch, None)
    inputs = tensors_of(value)
    if not inputs:
        raise ValueError("sample_batch holds no tensors; pass one minibatch of model input")
    if inputs[0].dim() and inputs[0].shape[0] == 0:
        raise ValueError("sample_batch holds 0 samples; pass a minibatch of at least one")
    layers = LayeredModel(model, value)
    source = Source.of(model, weights, seed)
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    measured = []
    slow: set[tuple[Any, ...]] = set()  # the kinds of layers run already that took over layer_seconds
    steps: dict[tuple[Any, ...], tuple[float, int]] = {}  # optimizer (seconds, state bytes) by parameter shapes
    runs = _Runs(repeats, warmup, layer_seconds, optimizer, compile)
    compile_s = 0.0
    # each layer is a graph of its own, and layers of one kind share their forward's code, whose
    # graphs dynamo caches up to a limit (8) before running the code eagerly: let every layer compile
    limit: Any = contextlib.nullcontext()
    if compile:
        from torch._dynamo import config as dynamo  # noqa: PLC0415 - seconds to import, only where asked for

        limit = dynamo.patch(recompile_limit=4 * len(layers))
    try:
        with limit:
            trains_before = False  # whether a layer before k trains: else no backward needs k's input gradient
            for k in range(len(layers)):
                last = loss_fn is not None and k == len(layers) - 1
                head = (lambda y: loss_fn(y, target)) if last and loss_fn is not None else None
                # the stage lives in this call alone: it is let go before the next layer's is built
                layer, value, compiling_s = _profile_layer(layer_stage(layers, k, k, source, inputs[0].device),
                                                           layers.labels[k], value, trains_before, head, runs, slow,
                                                           steps)
                measured.append(layer)
                trains_before = trains_before or layer.gradient_bytes > 0
                compile_s += compiling_s
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)
    first = inputs[0]
    return Profile(measured, int(first.shape[0]) if first.dim() else 1, str(first.device), type(model).__name__,
                   _nbytes(inputs), ties=list(layers.tied_layers().values()),
                   meta={"compiled": True, "compile_s": compile_s} if compile else {})


def as_minibatch(micro: Profile, m: int) -> Profile:
    """The profile of a minibatch run as ``m`` microbatches of ``micro``'s batch one after another, for
    simulating a microbatched schedule (which times a microbatch as its stage's minibatch time over
    ``m``): forward, backward and bytes ``m`` times ``micro``'s, the optimizer step once. A profile taken
    at the whole minibatch and divided by ``m`` would be optimistic on a CPU, whose seconds per row grow
    as the batch shrinks."""
    layers = [replace(x, forward_s=x.forward_s * m, backward_s=x.backward_s * m,
                      activation_bytes=x.activation_bytes * m,
                      weight_backward_s=None if x.weight_backward_s is None else x.weight_backward_s * m)
              for x in micro.layers]
    return replace(micro.building_scaled(m), layers=layers, batch_size=micro.batch_size * m,
                   input_bytes=micro.input_bytes * m,
                   meta={**micro.meta, "measured_at_batch": micro.batch_size, "microbatches": m})


def time_batching(dataset: Any, rows: int, repeats: int = 3, target_key: TargetKey = DEFAULT_TARGET_KEY,
                  collate_fn: Callable[[list[Any]], Any] | None = None) -> tuple[float, float, float]:
    """Seconds to build a minibatch of the first ``rows`` items' inputs, of their targets, and of both at
    once, from ``dataset`` (of ``(input, target)`` pairs or dictionaries, split by ``target_key`` after
    ``collate_fn``), each as a worker builds it
    (:func:`pipetrain.batches.collate_parts`; its first stage builds the inputs, its last the
    targets, a worker that is both builds both). Medians of ``repeats`` runs after one untimed, the
    three interleaved so that each sees the same phases of the machine."""
    dataset = head(dataset, rows)
    items = range(min(rows, len(dataset)))
    kinds = ((0,), (1,), (0, 1))
    times: list[list[float]] = [[] for _ in kinds]
    for _ in range(repeats + 1):
        for k, parts in enumerate(kinds):
            start = time.perf_counter()
            collate_parts(dataset, items, parts, target_key, collate_fn)
            times[k].append(time.perf_counter() - start)
    inputs_s, targets_s, both_s = (statistics.median(t[1:]) for t in times)
    return inputs_s, targets_s, both_s


@dataclass(frozen=True)
class _Runs:
    """How :func:`profile_model` runs each layer: its ``repeats``, ``warmup``, ``layer_seconds``,
    ``optimizer`` and ``compile``."""

    repeats: int
    warmup: int
    seconds: float | None
    optimizer: Callable[..., torch.optim.Optimizer] | None
    compile: bool = False


def _profile_layer(stage: nn.Module, label: str, value: Any, input_grads: bool, head: Callable[[Any], torch.Tensor] | None,
                   runs: _Runs, slow: set[tuple[Any, ...]], steps: dict[tuple[Any, ...], tuple[float, int]]
                   ) -> tuple[LayerProfile, Any, float]:
    """The profile of one layer's ``stage`` run on ``value``, its output (detached) and the seconds its
    compilation took (0 unless ``runs.compile``); ``slow`` and ``steps`` carry what earlier layers showed
    (see :func:`profile_model`'s ``layer_seconds``)."""
    kind = _kind(stage, value)
    compile_s = 0.0
    if runs.compile:
        compile_stage(stage, f"layer {label}")
        began = time.perf_counter()
        _time_layer(stage, value, input_grads, head, 1, 0)  # its first run compiles: timed apart
        compile_s = time.perf_counter() - began
    fwd, bwd, weight, out = _time_layer(stage, value, input_grads, head, runs.repeats,
                                        0 if kind in slow else runs.warmup, runs.seconds)
    if runs.seconds is not None and (fwd + bwd) * (runs.warmup + runs.repeats) > runs.seconds:
        slow.add(kind)
    params = list(stage.parameters())
    trainable = [p for p in params if p.requires_grad]
    shapes = tuple(p.shape for p in trainable)
    if runs.optimizer is None:
        step: tuple[float, int] = (0.0, 0)
    elif runs.seconds is not None and shapes in steps:  # the same step on the same shapes
        step = steps[shapes]
    else:
        step = steps[shapes] = _time_optimizer(stage, runs.optimizer, runs.repeats, runs.warmup, runs.seconds)
    return LayerProfile(label, fwd, bwd, _nbytes(out), tensor_bytes(params), step[0], weight, tensor_bytes(trainable),
                        step[1]), out, compile_s


def _kind(stage: nn.Module, x: Any) -> tuple[Any, ...]:
    """What makes a layer's run the same as another's: its modules' types, its parameters' shapes and
    its input's shapes (a graph layer's operator is in its code)."""
    code = stage.code if isinstance(stage, (torch.fx.GraphModule, CodeStage)) else ""
    return (code, tuple(type(m).__name__ for m in stage.modules()), tuple(p.shape for p in stage.parameters()),
            tuple(t.shape for t in tensors_of(x)))


def _runs(first_s: float, repeats: int, warmup: int, seconds: float | None) -> tuple[int, int]:
    """(repeats, warmup) for something whose first run took ``first_s``: as given, or within ``seconds``
    (see :func:`profile_model`'s ``layer_seconds``)."""
    if seconds is None or first_s * (warmup + repeats) <= seconds:
        return repeats, warmup
    if first_s > seconds:  # what a first run costs over the others is little beside seconds of work
        return 1, 0
    warmup = min(warmup, 1)
    return max(1, min(repeats, int(seconds / max(first_s, 1e-12)) - warmup)), warmup


def _time_layer(stage: nn.Module, x: Any, input_grads: bool, loss: Callable[[Any], torch.Tensor] | None,
                repeats: int, warmup: int, seconds: float | None = None) -> tuple[float, float, float, Any]:
    """(median forward s, median backward s, median seconds of the backward's weight-gradient part, the
    output detached) of one layer; the part is the backward less one of the inputs' gradient alone."""
    params: list[torch.Tensor] = [p for p in stage.parameters() if p.requires_grad]
    cuda = any(t.is_cuda for t in tensors_of(x)) or any(p.is_cuda for p in params)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    forward: list[float] = []
    backward: list[float] = []
    weight: list[float] = []
    run, first_s = 0, time.perf_counter()
    while run < warmup + repeats:
        leaves = map_tensors(x, lambda t: t.detach().requires_grad_(input_grads and t.is_floating_point()))
        # The layer gets copies: an in-place first op must not fail on a leaf or change the input.
        feed = map_tensors(leaves, torch.clone)
        sync()
        t0 = time.perf_counter()
        y = call(stage, feed)
        head = y if loss is None else loss(y)
        sync()
        t1 = time.perf_counter()
        roots = [t for t in tensors_of(head) if t.requires_grad]
        into = [t for t in tensors_of(leaves) if t.requires_grad]
        seeds = [torch.ones_like(t) for t in roots]
        split = bool(roots and into and params)
        wrt = into + params
        sync()
        t2 = time.perf_counter()
        if roots and wrt:
            torch.autograd.grad(roots, wrt, seeds, allow_unused=True, retain_graph=split)
        sync()
        t3 = time.perf_counter()
        if split:  # the inputs' gradient alone, on the same graph
            torch.autograd.grad(roots, into, seeds, allow_unused=True)
        sync()
        if run == 0:
            repeats, warmup = _runs(time.perf_counter() - first_s, repeats, warmup, seconds)
        if run >= warmup:
            forward.append(t1 - t0)
            backward.append(t3 - t2)
            # without inputs to send a gradient to, the whole backward is the weights'; without weights, none
            alone = time.perf_counter() - t3 if split else 0.0 if params else t3 - t2
            weight.append(max(0.0, t3 - t2 - alone))
        run += 1
    return statistics.median(forward), statistics.median(backward), statistics.median(weight), \
        map_tensors(y, torch.Tensor.detach)


def _time_optimizer(stage: nn.Module, optimizer: Callable[..., torch.optim.Optimizer], repeats: int,
                    warmup: int, seconds: float | None = None) -> tuple[float, int]:
    """Median seconds of one ``optimizer`` step (with ``zero_grad``) on ``stage``'s trainable parameters,
    with gradients of ones, and the bytes of the state it then keeps (each tensor once); the parameters
    and their ``.grad`` are left as they were."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0.0, 0
    before = [(p.detach().clone(), p.grad) for p in params]
    cuda = any(p.is_cuda for p in params)
    opt = optimizer(params)
    times: list[float] = []
    repeats, run = max(repeats, 1), 0
    try:
        while run < warmup + repeats:
            first_s = time.perf_counter()
            for p in params:
                p.grad = torch.ones_like(p)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if run == 0:
                repeats, warmup = _runs(time.perf_counter() - first_s, repeats, warmup, seconds)
            if run >= warmup:
                times.append(time.perf_counter() - t0)
            run += 1
    finally:
        with torch.no_grad():
            for p, (data, grad) in zip(params, before):
                p.copy_(data)
                p.grad = grad
    state = {t.data_ptr(): t for per in opt.state.values() for t in per.values() if isinstance(t, torch.Tensor)}
    return statistics.median(times), tensor_bytes(state.values())


def _nbytes(value: Any) -> int:
    return tensor_bytes(tensors_of(value))
