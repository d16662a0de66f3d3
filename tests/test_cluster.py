"""The emulated cluster: real namespaces, a real rate limit, gloo across hosts, and teardown on every exit.

Needs root, iproute2 and a kernel with tbf; skipped otherwise (the reason says which).
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pipetrain.bench.cluster import ClusterError, EmulatedCluster, socket_throughput, unavailable_reason
from pipetrain.bench.measure import PeerConfig
from pipetrain.bench.torch_peers import ddp


@pytest.fixture(scope="module")
def can_build() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _allreduce() -> dict:
    """Rank r contributes r+1; every rank should see 1 + 2."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    out = {"sum": float(t[0]), "ifname": os.environ["GLOO_SOCKET_IFNAME"], "addr": os.environ["MASTER_ADDR"]}
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_tc_gets_the_rate_the_planner_reads(can_build: None) -> None:
    """``10mbps`` is megabytes per second to tc and to the planner (tests/test_units.py): 80 Mbit/s on every link."""
    with EmulatedCluster(2, link="10mbps") as c:
        assert c.rate == 8 * 10**7
        shown = [subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
                 for ns, dev in [(c.names[0], "eth0"), (c.names[1], "eth0"), (c.switch, "p0"), (c.switch, "p1")]]
    assert all("rate 80Mbit" in s for s in shown), shown


def test_without_root_or_iproute2_the_error_says_so() -> None:
    with mock.patch("os.geteuid", return_value=1000), pytest.raises(ClusterError, match="needs root"):
        with EmulatedCluster(2):
            pass
    with mock.patch("os.geteuid", return_value=0), mock.patch("shutil.which", return_value=None), \
            pytest.raises(ClusterError, match="iproute2"):
        with EmulatedCluster(2):
            pass


@pytest.mark.multiprocess
def test_tbf_limits_the_link(can_build: None) -> None:
    """An iperf-like stream through a 100 Mbit/s link never beats it (how close its payload comes, at most
    1448 of 1514 bytes a frame: benchmarks/auto_pick.py)."""
    with EmulatedCluster(2, link="100mbit") as c:
        r = socket_throughput(c, 0, 1, seconds=1.5)
    assert 0 < r["bits_per_s"] < 101e6, r
    assert r["wire_bytes"] >= r["bytes"]


@pytest.mark.multiprocess
def test_gloo_allreduce_across_namespaces(can_build: None) -> None:
    with EmulatedCluster(2) as c:
        before = [c.tx_bytes(i) for i in range(2)]
        results = c.spawn(_allreduce, timeout=120)
        sent = [c.tx_bytes(i) - b for i, b in enumerate(before)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert results[0]["ifname"] == "eth0" and results[0]["addr"] == c.ips[0]
    assert all(s > 4000 for s in sent), sent  # each host sent at least its 4,000-byte tensor


@pytest.mark.multiprocess
def test_ddp_counted_bytes_match_the_interface_counters(can_build: None) -> None:
    cfg = PeerConfig(model="mnist-mlp", model_kwargs={"hidden": (16, 16)}, batch_size=16, warmup=1, windows=2,
                     steps_per_window=2, timeout_s=60)
    with EmulatedCluster(2) as c:
        results = c.spawn(ddp, (cfg,), timeout=120)
    for r in results:
        assert r["iface_bytes_per_sample"] == pytest.approx(r["counted_bytes_per_sample"], rel=0.1)


@pytest.mark.multiprocess
def test_teardown_after_an_exception(can_build: None) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2) as c:
            names = [*c.names, c.switch]
            assert set(names) <= namespaces()
            sleeper = c.popen(0, ["sleep", "600"])
            raise RuntimeError("boom")
    assert not set(names) & namespaces()
    assert sleeper.poll() is not None
    with pytest.raises(ClusterError, match="not running"):
        c.tx_bytes(0)


@pytest.mark.multiprocess
def test_teardown_on_sigterm(can_build: None) -> None:
    script = textwrap.dedent("""
        import sys, time
        from pipetrain.bench.cluster import EmulatedCluster
        with EmulatedCluster(2) as c:
            print(" ".join([*c.names, c.switch]), flush=True)
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    names = set(p.stdout.readline().split())  # type: ignore[union-attr]
    assert len(names) == 3 and names <= namespaces()
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    assert not names & namespaces()


@pytest.mark.multiprocess
def test_delay_needs_netem(can_build: None) -> None:
    before = namespaces()
    try:
        with EmulatedCluster(2, delay="1ms") as c:
            qdiscs = subprocess.run(["tc", "-n", c.names[0], "qdisc", "show"], capture_output=True, text=True).stdout
        assert "netem" in qdiscs and "tbf" in qdiscs
    except ClusterError as e:
        assert "netem" in str(e) and "\n" not in str(e)
    assert namespaces() <= before
