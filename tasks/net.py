"""Addresses of this process's node (for rendezvous and advertised server URLs)."""

from __future__ import annotations

import random
import socket
import sys


def node_ip() -> str:
    """This node's IP as Ray knows it (inside an actor), else the host name's address.

    tasks/ never imports Ray: a process where Ray is initialized (an actor, or the driver) has it
    loaded already, and only then is Ray asked."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def free_port(host: str = "") -> int:
    """A TCP port free now on this node (bound on all interfaces unless `host` is given).

    Taken at random below the kernel's ephemeral range: a port the kernel hands out (bind to 0) is also what
    every outgoing connection on the node gets, and on a busy node (Ray, Prefect, S3 clients) one of those can
    take it between this check and the caller's own bind (seen as EADDRINUSE at a rendezvous)."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(max(1024, low - EPHEMERAL_MARGIN), low), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a node that uses the low ports too
        s.bind((host, 0))
        return s.getsockname()[1]


# How many ports below the ephemeral range free_port picks from.
EPHEMERAL_MARGIN = 12_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
