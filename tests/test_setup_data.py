"""The run set-up as data: what a saved set-up must hold, and what one saved by an older version
loads as."""
from __future__ import annotations

import dataclasses
import json

import pytest

from handmade import MS, setup, two_layers

from pipetrain.jsonfile import read_field
from pipetrain.profiling import Profile
from pipetrain.setup import Setup


def test_a_setups_codec_cpu_must_be_numbers_by_codec():
    fields = dataclasses.asdict(setup(codec_ring_cpu_s={"quant8": 5 * MS}, ring_cpu_bytes=800))
    assert Setup.from_dict(fields, read_field).codec_ring_cpu("quant8", 2, 800) == 5 * MS
    with pytest.raises(ValueError, match=r"setup.codec_ring_cpu_s: 'quant8' is -1"):
        Setup.from_dict({**fields, "codec_ring_cpu_s": {"quant8": -1}}, read_field)
    with pytest.raises(ValueError, match=r"'setup.codec_ring_cpu_s' is 3, not an object"):
        Setup.from_dict({**fields, "codec_ring_cpu_s": 3}, read_field)
    with pytest.raises(ValueError, match=r"'setup.idle_ring_s' is 3, not an object"):
        Setup.from_dict({**fields, "idle_ring_s": 3}, read_field)
    assert Setup.from_dict({**fields, "idle_ring_s": {"none": 0.01}}, read_field).idle_ring("none", 2, 800) == 0.01


def test_a_setup_saved_with_a_key_no_longer_measured_loads_without_it():
    """A profile saved by an older version may hold set-up keys that are no field any more."""
    saved = two_layers(setup(jitter_s=1e-4)).to_dict()
    saved["setup"]["resampled_s"] = 1.5
    assert Profile.from_dict(json.loads(json.dumps(saved))).setup == setup(jitter_s=1e-4)


def test_a_setup_saved_before_the_allreduces_were_measured_loads_and_prices_with_messages():
    fields = {k: v for k, v in dataclasses.asdict(setup()).items() if "ring" not in k and "allreduce" not in k}
    old = Setup.from_dict(fields, read_field)
    assert (old.ring_latency_s, old.ring_s_per_byte, old.allreduce_latency_s, old.allreduce_cpu_s,
            old.ring_cpu_s, old.ring_cpu_s_per_byte, old.idle_ring_latency_s, old.idle_ring_s_per_byte) == (0.0,) * 8
    assert old.codec_ring_cpu_s == {} and old.codec_ring_cpu("quant8", 2, 0) is None
    assert old.allreduce_terms(ours=True) == old.allreduce_terms(ours=False) == (old.latency_s, old.s_per_byte)
    ring_only = dataclasses.replace(old, ring_s_per_byte=2e-9, allreduce_latency_s=1 * MS)
    assert ring_only.allreduce_terms(ours=False) == (1 * MS, 2e-9)  # the ring's β stands in for the backend's
    probed = dataclasses.replace(ring_only, allreduce_s_per_byte=5e-9, allreduce_bytes=1000)
    assert probed.allreduce_terms(ours=False, nbytes=1000) == (1 * MS, 5e-9)
    assert probed.allreduce_terms(ours=False) == probed.allreduce_terms(ours=False, nbytes=1001) == (1 * MS, 2e-9)
