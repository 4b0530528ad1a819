"""``bench.local.free_port``: ports that nothing bound to port 0 (Ray's own components) can take meanwhile."""

import socket
from pathlib import Path

from kairos_ray.bench import local
from kairos_ray.bench.local import FREE_PORTS, free_port


def test_a_free_port_is_bindable_and_outside_the_kernels_ephemeral_ports():
    port = free_port()
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert port in FREE_PORTS and not low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        other = free_port()
        monkeypatch.setattr(local.random, "sample", lambda population, k: [taken, other])
        assert free_port() == other
