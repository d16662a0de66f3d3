"""A hand-made run set-up and profile, small enough that tests work out their costs by hand."""
from __future__ import annotations

from pipetrain.profiling import LayerProfile, Profile
from pipetrain.setup import Setup

MS = 1e-3


def setup(**changes: float) -> Setup:
    """One core for two single-thread workers: every message end's CPU comes out of the compute."""
    fields = dict(backend="gloo", workers=2, threads=1, cores=1, slowdown=2.0, latency_s=1 * MS, s_per_byte=1e-6,
                  message_cpu_s=0.2 * MS, message_cpu_s_per_byte=0.0, copy_s_per_byte=0.0)
    return Setup(**{**fields, **changes})  # type: ignore[arg-type]


def two_layers(with_setup: Setup | None) -> Profile:
    """Two layers of F 1 ms, B 2 ms and an optimizer step of 0.5 ms each; 1000-byte activations and
    400 bytes of weights each; a 10-byte input."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 1000, 400, optimizer_s=0.5 * MS) for i in range(2)]
    return Profile(layers, batch_size=1, device="test", input_bytes=10, setup=with_setup)
