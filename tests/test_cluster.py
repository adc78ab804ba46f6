"""The production topology, exercised (`pytest -m cluster`): hosts are network namespaces on a bridge (loopback
addresses without root), every service the real program (`python -m rollflow.infra.cluster up`):

- ctl: PostgreSQL 15 <- Prefect server; the S3 endpoint; head: `ray start --head` + `prefect worker --pool`;
  node1, node2: `ray start --address=head`, one `fake_gpu` each;
- a 3-iteration rl_train created from its pool deployment completes with engine and trainer on different Ray
  nodes (Ray's state API) and nothing written to a local store root; a colocated run puts both on one node;
- a local store.root with the multi-node cluster is refused in one line (exit 2) before any worker starts,
  from the CLI and from a pool run; a placement no node can hold fails in seconds naming what is missing.

One cluster per module (~2 min to bring up on 2 cores). `ROLLFLOW_TEST_CLUSTER=<state dir>` reuses a cluster
already up (`python -m rollflow.infra.cluster up --state-dir DIR`) instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.infra import cluster as cl

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

SMALL = {"data": {"prompts_per_rollout": 8}, "rollout": {"n_samples_per_prompt": 2, "threads": 1},
         "train": {"threads": 1}}
DISAGGREGATED = {"num_gpus": 2, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1,
                 "gpu_resource": cl.GPU_RESOURCE}
COLOCATED = {"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1,
             "gpu_resource": cl.GPU_RESOURCE}


def _missing_prerequisite() -> str | None:
    for name in ("initdb", "postgres", "pg_isready", "psql"):
        try:
            cl.pg_bin(name)
        except cl.ClusterError as exc:
            return str(exc)
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None and shutil.which("ray") is None:
        return "ray is not installed"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reuse = os.environ.get("ROLLFLOW_TEST_CLUSTER")
    if reuse:
        yield cl.Cluster.load(reuse)
        return
    missing = _missing_prerequisite()
    if missing:
        pytest.skip(f"the cluster needs PostgreSQL and Ray: {missing}")
    state = tmp_path_factory.mktemp("cluster")
    up = cl.up(state)
    try:
        print(f"cluster up in {up.up_s:.0f}s: {up.timings}")
        yield up
    finally:
        cl.down(state)


@pytest.fixture(scope="module")
def api(cluster):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    saved = {k: os.environ.get(k) for k in cluster.s3_env()}
    os.environ.update(cluster.s3_env())  # this process reads the bucket to check what the run wrote
    try:
        with temporary_settings({PREFECT_API_URL: cluster.prefect_api}):
            yield cluster.prefect_api
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_from_pool(flow_name: str, parameters: dict, timeout: float = 420):
    """Create a run from `<flow>/pool` (the UI's Run call) and wait until it is final."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"{flow_name}/pool")
        run = client.create_flow_run_from_deployment(dep.id, parameters=parameters)
        deadline = time.monotonic() + timeout
        while True:
            run = client.read_flow_run(run.id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {run.name} still {run.state.name if run.state else None}")
            time.sleep(1)


def _logs(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(entry.message for entry in logs)


def _task_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [t.name for t in runs]


def _actor_nodes(cluster: cl.Cluster, run: str) -> dict[str, set[str]]:
    """Role -> node ids of the run's actors (alive or dead) through Ray's state API."""
    from ray.util.state import list_actors

    out: dict[str, set[str]] = {}
    for actor in list_actors(address=cluster.dashboard_url, filters=[("ray_namespace", "=", "rollflow")],
                             detail=True, limit=10000, raise_on_missing_output=False):
        actor = actor if isinstance(actor, dict) else actor.__dict__
        name = actor.get("name") or ""
        if name.startswith(f"{run}:"):
            out.setdefault(name.split(":", 1)[1], set()).add(actor.get("node_id"))
    return out


def _node_ips(cluster: cl.Cluster) -> dict[str, str]:
    return {n["node_id"]: n["node_ip"] for n in cl.ray_nodes(cluster)}


def _local_files(cluster: cl.Cluster) -> list[str]:
    """Files a flow run could have written on the worker host: its working folder, Prefect's local result
    storage of the worker (and the flow processes it starts)."""
    roots = [Path(cluster.state_dir) / "worker", Path(cluster.state_dir) / "prefect-worker" / "storage"]
    return [str(p) for r in roots if r.exists() for p in r.rglob("*") if p.is_file()]


def _s3_ls(path: str) -> list[str]:
    from rollflow.artifacts.storage import open_fs

    fs, fs_path = open_fs(path)
    fs.invalidate_cache()
    return fs.ls(fs_path) if fs.exists(fs_path) else []


def _train_params(cluster: cl.Cluster, run: str, resources: dict, placement: str, iterations: int) -> dict:
    return {"params": {"run": run, "iterations": iterations, **cluster.run_params(), "placement": placement,
                       "resources": resources, **SMALL}}


def test_topology_is_up(cluster, api):
    nodes = cl.ray_nodes(cluster)
    ips = sorted(n["node_ip"] for n in nodes)
    assert ips == sorted(cluster.hosts[h] for h in ("head", *cl.WORKER_NODES))  # 3 nodes, distinct IPs
    assert sum(n["resources_total"].get(cl.GPU_RESOURCE, 0) for n in nodes) == 2
    status = cl.status(cluster.state_dir)
    assert status["prefect_healthy"] and all(status["alive"].values()), status
    assert cluster.database_url.startswith("postgresql+asyncpg://")


def test_disaggregated_rl_train_from_the_pool_spans_nodes_and_writes_only_to_s3(cluster, api):
    before = _local_files(cluster)
    t0 = time.monotonic()
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-dis", DISAGGREGATED, "disaggregated", 3))
    took = time.monotonic() - t0
    assert run.state.name == "Completed", _logs(run.id)
    print(f"3-iteration rl_train from the pool: {took:.1f}s")
    nodes = _actor_nodes(cluster, "cluster-dis")
    assert len(nodes["engine"]) == 1 and len(nodes["trainer"]) == 1, nodes
    assert nodes["engine"] != nodes["trainer"], nodes  # disaggregated: different Ray nodes
    ips = _node_ips(cluster)
    used = {ips[n] for n in nodes["engine"] | nodes["trainer"]}
    assert used == {cluster.hosts[n] for n in cl.WORKER_NODES}, used  # on the GPU nodes, not the head
    rollouts = _s3_ls(f"{cluster.store_root}/cluster-dis/rollouts/train")
    assert len(rollouts) == 3, rollouts
    assert _local_files(cluster) == before  # nothing under a local store root or local result storage


def test_colocated_run_shares_one_node(cluster, api):
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-col", COLOCATED, "colocate", 1))
    assert run.state.name == "Completed", _logs(run.id)
    nodes = _actor_nodes(cluster, "cluster-col")
    assert nodes["engine"] == nodes["trainer"] and len(nodes["engine"]) == 1, nodes


def test_local_store_root_refused_from_the_cli_in_one_line(cluster, tmp_path):
    root = tmp_path / "runs"
    ns = cluster.namespace("head")
    argv = (["ip", "netns", "exec", ns] if ns else []) + [
        str(Path(sys.executable).with_name("rollflow")), "train", "--set", f"ray.address={cluster.ray_address}",
        "--set", f"store.root={root}", "--set", "iterations=1"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **cluster.client_env(), "COLUMNS": "400"})
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "store.root=" in lines[0] and "s3://" in lines[0] and "store.shared_filesystem=true" in lines[0], lines[0]
    assert "3 nodes" in lines[0], lines[0]
    assert not root.exists()  # refused before anything was written
    print(f"refused in {took:.1f}s")


def test_local_store_root_refused_in_a_pool_run_before_any_worker(cluster, api, tmp_path):
    params = _train_params(cluster, "cluster-local", DISAGGREGATED, "disaggregated", 1)
    params["params"]["store"] = {"root": str(tmp_path / "runs")}
    run = _run_from_pool("rl_train", params, timeout=180)
    assert run.state.name == "Failed"
    logs = _logs(run.id)
    assert "is a local path, but the Ray cluster" in logs and "store.shared_filesystem=true" in logs, logs
    assert not any(n.startswith("start-workers") for n in _task_names(run.id))
    assert not _actor_nodes(cluster, "cluster-local")


def test_unsatisfiable_placement_fails_in_seconds_naming_what_is_missing(cluster, api):
    resources = {**DISAGGREGATED, "cpus_per_bundle": 4}  # nodes have 2 CPUs each: the totals suffice, no node does
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-big", resources, "disaggregated", 1),
                         timeout=180)
    assert run.state.name == "Failed"
    logs = _logs(run.id)
    assert "cannot be placed" in logs and "no node has CPU 4" in logs, logs
    seconds = (run.end_time - run.start_time).total_seconds()
    assert seconds < 30, seconds  # not a pending-forever placement group (create_placement_group waits 60 s)

