"""Addresses of this process's node (for rendezvous and advertised server URLs)."""

from __future__ import annotations

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
    """A TCP port free now on this node (bound on all interfaces unless `host` is given)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
