"""`free_port` hands out ports outside the kernel's ephemeral range, where no outgoing connection of a busy node
(Ray, Prefect, S3 clients) can take the port between the check and the rendezvous's own bind."""

from __future__ import annotations

import socket

from rollflow.tasks.net import free_port


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(v) for v in f.read().split())
    return low, high


def test_ports_are_below_the_ephemeral_range_and_bindable():
    low, _high = _ephemeral_range()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # picked at random, so two processes asking at once rarely collide
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out():
    low, _high = _ephemeral_range()
    held = []
    try:
        # hold most of the candidate ports: what is left must still be free
        for port in range(low - 2000, low):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(10):
            port = free_port("127.0.0.1")
            assert port not in taken
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
