"""Addresses of this process's node (for rendezvous and advertised server URLs)."""

from __future__ import annotations

import socket


def node_ip() -> str:
    """This node's IP as Ray knows it (inside an actor), else the host name's address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def free_port(host: str = "") -> int:
    """A TCP port free now on this node (bound on all interfaces unless `host` is given)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
