"""What a multi-node Ray cluster asks of a run's config, checked before any worker starts.

Nodes of a Ray cluster do not share disks: an artifact a trainer on one node writes under a local path is
not there for the engine on another, nor for the flow process that reads metrics. So with a cluster of
more than one node, a local `store.root` is refused (one line, the field and both fixes) unless the run
declares `store.shared_filesystem=true` (every node mounts the path: NFS, Lustre).
"""

from __future__ import annotations

from rollflow.flows.config import RunConfig
from rollflow.flows.input_errors import PreflightError
from rollflow.infra.workers import NAMESPACE


def local_root(root: str) -> str | None:
    """The local path of a store root (`file://` or a bare path); None for object stores."""
    if root.startswith("file://"):
        return root[len("file://") :]
    return None if "://" in root else root


def check_store_for_nodes(cfg: RunConfig, nodes: int) -> None:
    """Raise PreflightError when a local store.root meets a Ray cluster of `nodes` > 1 nodes."""
    if nodes <= 1 or cfg.store.shared_filesystem or local_root(cfg.store.root) is None:
        return
    where = f"the Ray cluster at {cfg.ray.address}" if cfg.ray.address else "the Ray cluster"
    raise PreflightError(
        f"store.root={cfg.store.root!r} is a local path, but {where} has {nodes} nodes, which do not share disks: "
        "use store.root=s3://bucket/prefix (credentials from the AWS environment), or set "
        "store.shared_filesystem=true if every node mounts that path (NFS, Lustre)"
    )


def alive_nodes() -> int:
    """Alive nodes of the Ray cluster this process is connected to."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def check_cluster_store(cfg: RunConfig) -> None:
    """With `ray.address` set: join the cluster (the run joins it next anyway) and check the store against
    its node count. A local Ray (no address) is one node: nothing to check."""
    if not cfg.ray.address or cfg.store.shared_filesystem or local_root(cfg.store.root) is None:
        return
    import logging
    import os

    import ray

    if not ray.is_initialized():  # as infra.workers.ensure_ray joins it, minus Ray's INFO lines on the console
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=cfg.ray.address, namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
    check_store_for_nodes(cfg, alive_nodes())
