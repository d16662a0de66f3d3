"""An emulated cluster on one Linux machine: a network namespace per host, a bridge, rate-limited links.

```
  pt-<id>-h0            pt-<id>-sw              pt-<id>-h1
 ┌────────────┐       ┌─────────────┐       ┌────────────┐
 │ eth0 ══════╪═veth══╪ p0  br0  p1 ╪══veth═╪══════ eth0 │
 │ 10.213.0.1 │  tbf  │             │  tbf  │ 10.213.0.2 │
 └────────────┘       └─────────────┘       └────────────┘
```
Each host's ``eth0`` sends through a token bucket (``tc ... tbf``) at the link rate, and so does the
bridge port towards it, so a host can neither send nor receive faster than its link: a full-duplex NIC
on a non-blocking switch. The addresses exist only inside these namespaces and the bridge lives in its
own namespace, so nothing on the machine's own interfaces changes. Everything is removed on exit, also
when the body raises or the process gets SIGTERM.

Processes started with :meth:`EmulatedCluster.popen` (or :meth:`EmulatedCluster.spawn`) run inside a
host's namespace via ``ip netns exec``; there ``eth0`` is the only way out, so torch.distributed must be
told to use it: see [Note: gloo interface].
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from pipetrain.planning.units import parse_bandwidth
from pipetrain.errors import PipetrainError


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here; the one-line message says why."""


IFACE = "eth0"
"""Each host's interface to the bridge (the same name in every host namespace)."""


def link_bits_per_s(link: str | float) -> int:
    """A link rate in bits per second, read by :func:`pipetrain.planning.units.parse_bandwidth`.

    So ``1gbit`` is 10**9 and ``10mbps`` (megabytes, as in tc) 8 * 10**7, exactly as the planner reads
    them; the cluster hands ``tc`` this integer in ``bit``, a rate it cannot misread.

    Raises:
        ValueError: not a bandwidth (the message shows how to write one).
    """
    return round(parse_bandwidth(link) * 8)


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built on this machine, or None when it can.

    Builds and removes a one-host cluster, so it takes a fraction of a second.
    """
    try:
        with EmulatedCluster(1):
            return None
    except ClusterError as e:
        return str(e)


class EmulatedCluster:
    """``n_hosts`` network namespaces joined by a bridge, each link limited to ``link``.

    Use as a context manager; the namespaces exist between ``__enter__`` and ``__exit__``.

    Args:
        n_hosts: hosts (namespaces) to create.
        link: each host's send and receive rate (``1gbit``, ``100mbit``; ``10mbps`` is megabytes per
            second, as in tc: see :func:`pipetrain.planning.units.parse_bandwidth`).
        delay: one-way delay added on each host's egress (``2ms``); needs the ``netem`` qdisc.
        subnet: the first three octets of the private /24 used inside the namespaces.

    Attributes:
        names: the host namespaces' names, ``pt-<pid>-<random>-h<i>``.
        ips: the hosts' addresses, ``<subnet>.<i+1>``.
        rate: the link in bits per second, given to ``tc`` as ``<rate>bit``.

    Raises:
        ClusterError (on enter): not root, no iproute2, or the kernel lacks tbf (or netem for ``delay``).
    """

    def __init__(self, n_hosts: int, link: str | float = "1gbit", delay: str | None = None,
                 subnet: str = "10.213.0") -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts={n_hosts} must be between 1 and 250")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet={subnet!r} must be three octets of 10.0.0.0/8, like '10.213.0'")
        self.n_hosts = n_hosts
        self.link = link
        self.rate = link_bits_per_s(link)
        self.delay = delay
        tag = f"pt-{os.getpid()}-{secrets.token_hex(2)}"
        self.names = [f"{tag}-h{i}" for i in range(n_hosts)]
        self.switch = f"{tag}-sw"
        self.ips = [f"{subnet}.{i + 1}" for i in range(n_hosts)]
        self._made: list[str] = []  # namespaces created so far, in order
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm: Any = None
        self._open = False

    # -- building and tearing down --------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        if os.geteuid() != 0:
            raise ClusterError("EmulatedCluster needs root (CAP_NET_ADMIN) to create network namespaces; "
                               "run as root or benchmark on loopback")
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            raise ClusterError(f"EmulatedCluster needs iproute2 ({' and '.join(missing)} not found); "
                               "install iproute2 or benchmark on loopback")
        self._open = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        try:
            self.close()
        except ClusterError as e:
            if exc_type is None:
                raise
            print(f"pipetrain: {e}", file=sys.stderr)  # do not hide the body's exception behind ours

    def _build(self) -> None:
        sw = self.switch
        self._netns_add(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(self.names, self.ips)):
            self._netns_add(ns)
            _ip("-n", ns, "link", "add", IFACE, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            self._shape(ns, IFACE, self.delay)
            self._shape(sw, f"p{i}", None)

    def _netns_add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        """A token bucket at the link rate on ``dev``'s egress, behind a netem delay when asked."""
        # Bucket: 4 ms of traffic (at least 64 KiB, so a 64 KiB GSO packet passes whole); queue: 50 ms.
        burst = max(64 * 1024, self.rate // 8 // 250)
        tbf = ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "50ms"]
        if delay is None:
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
            return
        try:
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay,
                "limit", "100000")
        except ClusterError as e:
            if "unknown" in str(e).lower():
                raise ClusterError(f"delay={delay!r} needs the netem qdisc (sch_netem), which this kernel "
                                   "lacks; use delay=None (rate limiting needs only tbf)") from None
            raise
        _tc("-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)

    def close(self) -> None:
        """Stop what runs in the hosts and delete every namespace (and with them the veths and bridge)."""
        if not self._open:
            return
        self._open = False
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        errors = []
        for ns in reversed(self._made):
            # Anything still inside was started in this namespace, hence by this cluster's user.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode:
                errors.append(f"{ns}: {r.stderr.strip()}")
        self._made.clear()
        atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if errors:
            raise ClusterError("could not delete namespaces: " + "; ".join(errors))

    # -- using the hosts ------------------------------------------------------------------------------

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``'s namespace; it is stopped when the cluster closes."""
        self._check_open()
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], env=env, **kwargs)
        self._procs.append(p)
        return p

    def env(self, i: int, world: int | None = None, port: int = 29500) -> dict[str, str]:
        """Environment for rank ``i`` of a torch.distributed job over the hosts (as torchrun would set).

        [Note: gloo interface] Without ``GLOO_SOCKET_IFNAME``, gloo advertises the address the
        machine's hostname resolves to: 127.0.0.1 on many machines (/etc/hosts), which inside each
        namespace is that namespace's own loopback, or an address of the root namespace, unreachable
        from here. Either way ``init_process_group`` fails with "connectFullMesh failed ... Connection
        refused". ``GLOO_SOCKET_IFNAME=eth0`` makes gloo bind and advertise the namespace's own address.
        """
        return {**os.environ, "RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(world or self.n_hosts),
                "MASTER_ADDR": self.ips[0], "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": IFACE}

    def spawn(self, fn: Callable[..., Any], args: tuple = (), world: int | None = None, port: int = 29500,
              timeout: float | None = None, poll_s: float = 0.05) -> list[Any]:
        """Run ``fn(*args)`` as rank i on host i (i < ``world``, default all hosts); return each rank's result.

        Like :func:`pipetrain.runtime.launch.spawn`, but each rank in its own namespace with
        :meth:`env`'s variables; ``fn`` must be importable (module level) and its result plain data.

        Raises:
            PipetrainError: a rank raised (its first line is the message), died, or ``timeout`` passed.
        """
        world = world or self.n_hosts
        if world > self.n_hosts:
            raise ValueError(f"world={world} but the cluster has {self.n_hosts} hosts")
        with tempfile.TemporaryDirectory(prefix="pipetrain-cluster-") as workdir:
            with open(Path(workdir) / "job.pkl", "wb") as f:
                pickle.dump(sys.path, f)  # first, so the child can import fn's module
                pickle.dump((fn, args), f)
            procs = [self.popen(r, [sys.executable, "-m", "pipetrain.bench._host", workdir, str(r)],
                                env=self.env(r, world, port)) for r in range(world)]
            start = time.monotonic()
            try:
                while any(p.poll() is None for p in procs):
                    failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                    if failed:
                        raise PipetrainError(_failure(workdir, failed, procs))
                    if timeout is not None and time.monotonic() - start > timeout:
                        raise PipetrainError(f"cluster job still running after {timeout:g} s")
                    time.sleep(poll_s)
                failed = [r for r, p in enumerate(procs) if p.returncode != 0]
                if failed:
                    raise PipetrainError(_failure(workdir, failed, procs))
                return [torch.load(Path(workdir) / f"result{r}.pt", weights_only=True) for r in range(world)]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()

    def counters(self, i: int) -> dict[str, int]:
        """Bytes and packets host ``i``'s ``eth0`` has sent and received (tx_bytes, rx_bytes, ...)."""
        self._check_open()
        r = subprocess.run(["ip", "-n", self.names[i], "-s", "-j", "link", "show", "dev", IFACE],
                           capture_output=True, text=True, check=True)
        stats = json.loads(r.stdout)[0]["stats64"]
        return {f"{d}_{k}": int(stats[d][k]) for d in ("tx", "rx") for k in ("bytes", "packets")}

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has sent so far (its ``eth0``'s counter, Ethernet headers included)."""
        return self.counters(i)["tx_bytes"]

    def _check_open(self) -> None:
        if not self._open:
            raise ClusterError("the cluster is not running; use it inside `with EmulatedCluster(...) as c:`")


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds through the `with` block, so __exit__ tears the namespaces down.
    raise SystemExit(128 + signum)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(*args: str) -> None:
    _run(["tc", *args])


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip() or r.stdout.strip() or f"exit code {r.returncode}").splitlines()[0]
        raise ClusterError(f"`{' '.join(argv)}` failed: {why}")


def _failure(workdir: str, failed: list[int], procs: list[subprocess.Popen]) -> str:
    """The first failed rank's own message (a rank's error beats a neighbour's complaint about it)."""
    messages = {}
    for r in failed:
        f = Path(workdir) / f"error{r}.txt"
        messages[r] = f.read_text().splitlines()[0] if f.exists() else \
            f"rank {r} died with exit code {procs[r].returncode}"
    return messages[failed[0]]


def socket_throughput(cluster: EmulatedCluster, src: int, dst: int, seconds: float = 2.0,
                      port: int = 5201) -> dict[str, float]:
    """Stream bytes over TCP from host ``src`` to host ``dst`` for ``seconds``, like ``iperf``.

    Returns:
        ``bits_per_s`` of payload as the receiver saw it (first byte to end of stream), ``bytes``
        received, ``seconds``, and ``wire_bytes``: the sender's ``eth0`` counter over the run.
    """
    tx0 = cluster.tx_bytes(src)
    mod = [sys.executable, "-m", "pipetrain.bench._sock"]
    recv = cluster.popen(dst, [*mod, "recv", cluster.ips[dst], str(port)], stdout=subprocess.PIPE, text=True)
    send = cluster.popen(src, [*mod, "send", cluster.ips[dst], str(port), str(seconds)],
                         stdout=subprocess.DEVNULL)
    out, _ = recv.communicate(timeout=seconds + 60)
    send.wait(timeout=30)
    if recv.returncode or send.returncode:
        raise ClusterError(f"socket throughput run failed (receiver exit {recv.returncode}, "
                           f"sender exit {send.returncode})")
    result = json.loads(out)
    result["wire_bytes"] = cluster.tx_bytes(src) - tx0
    return result
