"""The production topology on one machine: hosts as Linux network namespaces on a bridge, every service the
real program started the way an operator starts it.

```
ctl    10.231.0.10   PostgreSQL 15 <- Prefect server (API + UI)        moto S3 endpoint
head   10.231.0.11   ray start --head      prefect worker --pool rollflow-cluster (flow runs = Ray drivers)
node1  10.231.0.12   ray start --address=head  {"fake_gpu": 1, "node1": 1}
node2  10.231.0.13   ray start --address=head  {"fake_gpu": 1, "node2": 1}
```

`python -m rollflow.infra.cluster up|down|status [--state-dir DIR]`. `up` writes `cluster.json` (addresses,
URLs, pids) under the state dir; `down` stops every process it started by pid (and whatever is left in
its namespaces), then deletes the namespaces and the bridge. Without root (no `ip netns`), the same hosts
are distinct loopback addresses (127.231.0.x) and the netns-only drills (cutting a link) are skipped.
The flows' Prefect worker lives on the Ray head (docs/cluster.md says why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollflow.infra.processes import (  # noqa: F401 - ClusterError, stop_pid: the cluster's API
    ClusterError,
    alive,
    healthy,
    port_open,
    sh,
    stop_pid,
    wait_until,
)

PREFIX = "rf"  # namespaces rf-ctl, rf-head, rf-node1, rf-node2; bridge rfbr0; veths rfv-<host>
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.231.0"
GATEWAY = f"{SUBNET}.1"
LOOPBACK_SUBNET = "127.231.0"
HOSTS = {"ctl": 10, "head": 11, "node1": 12, "node2": 13}
WORKER_NODES = ("node1", "node2")
GPU_RESOURCE = "fake_gpu"  # a Ray custom resource standing for one GPU per worker node
POOL = "rollflow-cluster"
BUCKET = "rollflow"
RESULTS_BLOCK = "remote-file-system/rollflow-s3"
PORTS = {"postgres": 5432, "prefect": 4200, "s3": 5555, "ray": 6379, "dashboard": 8265}
# moto accepts any key; a real cluster gives its nodes real credentials (or a role) the same way
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "rollflow-test",
    "AWS_SECRET_ACCESS_KEY": "rollflow-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
OFFLINE = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "RAY_AUTH_MODE": "disabled",
}
# While its database refuses connections (a restart, a failover) the Prefect server answers 500, not 503: asyncpg's
# ConnectionRefusedError is not one of the errors it maps to "retryable". Without 500 in the retry codes a flow
# run gives up on the first state change in that window and its process exits, leaving the run Running for ever
# (drill b). Prefect's client backs off 2, 4, 8, 16, 32 s (5 retries): a restart of up to ~a minute is absorbed.
CLIENT_RETRIES = {"PREFECT_CLIENT_RETRY_EXTRA_CODES": "500"}
PG_BIN_DIRS = ("/usr/lib/postgresql/15/bin",)
STATE_FILE = "cluster.json"
DEFAULT_QUEUE = "default"  # the queue every deployment of the pool sends its runs to


@dataclass
class Cluster:
    state_dir: str
    mode: str  # "netns" or "loopback"
    hosts: dict[str, str]  # host -> IP
    pids: dict[str, int] = field(default_factory=dict)  # service -> pid (its process group)
    pg_dir: str = ""
    ray_dir: str = ""  # Ray's --temp-dir: short (its unix socket paths must stay under 108 bytes)
    up_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def prefect_api(self) -> str:
        return f"http://{self.hosts['ctl']}:{PORTS['prefect']}/api"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.hosts['ctl']}:{PORTS['s3']}"

    @property
    def database_url(self) -> str:
        return f"postgresql+asyncpg://postgres@{self.hosts['ctl']}:{PORTS['postgres']}/prefect"

    @property
    def ray_address(self) -> str:
        return f"{self.hosts['head']}:{PORTS['ray']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.hosts['head']}:{PORTS['dashboard']}"

    @property
    def store_root(self) -> str:
        return f"s3://{BUCKET}/runs"

    @property
    def results_root(self) -> str:
        return f"s3://{BUCKET}/prefect-results"

    def s3_env(self) -> dict[str, str]:
        return {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": self.s3_endpoint}

    def client_env(self) -> dict[str, str]:
        """What a process outside the cluster (a test, a CLI) needs to talk to it."""
        return {**OFFLINE, **CLIENT_RETRIES, **self.s3_env(), "PREFECT_API_URL": self.prefect_api}

    def namespace(self, host: str) -> str | None:
        return f"{PREFIX}-{host}" if self.mode == "netns" else None

    def run_params(self, **overrides: Any) -> dict[str, Any]:
        """RunConfig sections that point a run at this cluster (S3 store + results, the Ray head)."""
        return {
            "store": {"root": self.store_root, "results": RESULTS_BLOCK},
            "ray": {"address": self.ray_address},
            **overrides,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "prefect_api": self.prefect_api,
            "s3_endpoint": self.s3_endpoint,
            "database_url": self.database_url,
            "ray_address": self.ray_address,
            "dashboard_url": self.dashboard_url,
            "store_root": self.store_root,
            "pool": POOL,
            "results_block": RESULTS_BLOCK,
        }

    @classmethod
    def load(cls, state_dir: str | Path) -> "Cluster":
        data = json.loads((Path(state_dir) / STATE_FILE).read_text())
        keys = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in keys})

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(path)


# ----------------------------------------------------------------------------- helpers


def default_state_dir() -> Path:
    home = Path(os.environ.get("ROLLFLOW_HOME", Path.home() / ".rollflow"))
    return home / "cluster"


def netns_available() -> bool:
    """Root and iproute2: hosts can be network namespaces."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"{PREFIX}-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _bin(name: str) -> str:
    here = Path(sys.executable).with_name(name)
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise ClusterError(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def pg_bin(name: str) -> str:
    for folder in PG_BIN_DIRS:
        path = Path(folder) / name
        if path.exists():
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise ClusterError(f"PostgreSQL's {name} is not installed (Debian/Ubuntu: apt-get install postgresql-15)")
    return found


def _spawn(cluster: Cluster, name: str, host: str, argv: list[str], env: dict[str, str], cwd: str | None = None) -> int:
    """Start `argv` on `host` (inside its namespace), in a session of its own; records its pid."""
    log_path = Path(cluster.state_dir) / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ns = cluster.namespace(host)
    full = (["ip", "netns", "exec", ns] if ns else []) + argv  # `ip netns exec` execs: the pid is argv's
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            full,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **OFFLINE, **env},
            cwd=cwd,
            start_new_session=True,
        )
    cluster.pids[name] = proc.pid
    cluster.save()
    return proc.pid


def log_path(cluster: Cluster, name: str) -> Path:
    return Path(cluster.state_dir) / "logs" / f"{name}.log"


# ----------------------------------------------------------------------------- network


def _namespaces() -> set[str]:
    out = sh("ip", "netns", "list", check=False)
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def make_network(cluster: Cluster) -> None:
    """A bridge with the gateway address, and per host a namespace joined to it by a veth pair."""
    existing = {f"{PREFIX}-{h}" for h in HOSTS} & _namespaces()
    if existing:
        raise ClusterError(
            f"namespaces {sorted(existing)} exist: a cluster is up (or was not torn down); run "
            "`python -m rollflow.infra.cluster down` first"
        )
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for host, octet in HOSTS.items():
        ns, outer, inner = f"{PREFIX}-{host}", f"{PREFIX}v-{host}", f"{PREFIX}p-{host}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", outer, "master", BRIDGE)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "-n", ns, "link", "set", inner, "name", "eth0")
        sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{octet}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # a default route, so that "which of my addresses reaches the world" (Ray's node IP) answers eth0;
        # nothing is forwarded beyond the bridge
        sh("ip", "-n", ns, "route", "add", "default", "via", GATEWAY)


def delete_network() -> None:
    for host in HOSTS:
        ns = f"{PREFIX}-{host}"
        if ns in _namespaces():
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                stop_pid(int(pid), grace=3)
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", f"{PREFIX}v-{host}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def set_link(host: str, up: bool) -> None:
    """Cut (or restore) `host`'s only link: its veth end on the bridge (netns mode only)."""
    sh("ip", "link", "set", f"{PREFIX}v-{host}", "up" if up else "down")


# ----------------------------------------------------------------------------- services


def start_postgres(cluster: Cluster) -> None:
    """initdb + postgres (as the postgres user when we are root; PostgreSQL refuses to run as root), a
    `prefect` database with pg_trgm (Prefect's server needs it)."""
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="rollflow-pg-"))  # outside the state dir: the postgres user must reach it
    cluster.pg_dir = str(base)
    data = base / "data"
    data.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:
        os.chmod(base, 0o755)
        shutil.chown(data, "postgres", "postgres")
        as_user = [shutil.which("setpriv") or "setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
    os.chmod(data, 0o700)
    sh(
        *as_user,
        pg_bin("initdb"),
        "-D",
        str(data),
        "-A",
        "trust",
        "-U",
        "postgres",
        "--no-sync",
        "-E",
        "UTF8",
        timeout=120,
    )
    host = cluster.hosts["ctl"]
    subnet = host.rsplit(".", 1)[0] + ".0/24"
    with open(data / "pg_hba.conf", "a") as hba:  # the cluster's hosts (and its gateway) may connect
        hba.write(f"host all all {subnet} trust\n")
    pid = _spawn(cluster, "postgres", "ctl", _postgres_argv(cluster), {})
    ready = [pg_bin("pg_isready"), "-h", host, "-p", str(PORTS["postgres"]), "-U", "postgres"]
    wait_until(
        lambda: subprocess.run(ready, capture_output=True).returncode == 0,
        "PostgreSQL",
        60,
        log_path(cluster, "postgres"),
        pid,
    )
    psql = [pg_bin("psql"), "-h", host, "-p", str(PORTS["postgres"]), "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q"]
    sh(*psql, "-d", "postgres", "-c", "create database prefect")
    sh(*psql, "-d", "prefect", "-c", "create extension if not exists pg_trgm")
    cluster.timings["postgres_s"] = round(time.monotonic() - t0, 2)


def _postgres_argv(cluster: Cluster) -> list[str]:
    data = str(Path(cluster.pg_dir) / "data")
    as_user = (
        [shutil.which("setpriv") or "setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        if os.geteuid() == 0
        else []
    )
    return [
        *as_user,
        pg_bin("postgres"),
        "-D",
        data,
        "-p",
        str(PORTS["postgres"]),
        "-k",
        data,
        "-c",
        f"listen_addresses={cluster.hosts['ctl']}",
        "-c",
        "max_connections=200",
    ]


def restart_postgres(cluster: Cluster, down_s: float = 5.0) -> None:
    """A database restart: fast shutdown (SIGINT: sessions cut), `down_s` seconds without it, start again."""
    pid = cluster.pids["postgres"]
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    wait_until(lambda: not alive(pid), "PostgreSQL shutdown", 60)
    time.sleep(down_s)
    new = _spawn(cluster, "postgres", "ctl", _postgres_argv(cluster), {})
    ready = [pg_bin("pg_isready"), "-h", cluster.hosts["ctl"], "-p", str(PORTS["postgres"]), "-U", "postgres"]
    wait_until(
        lambda: subprocess.run(ready, capture_output=True).returncode == 0,
        "PostgreSQL (restarted)",
        60,
        log_path(cluster, "postgres"),
        new,
    )


def start_prefect_server(cluster: Cluster) -> None:
    t0 = time.monotonic()
    home = Path(cluster.state_dir) / "prefect-server"
    home.mkdir(parents=True, exist_ok=True)
    host = cluster.hosts["ctl"]
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": cluster.database_url,
        "PREFECT_UI_API_URL": cluster.prefect_api,
        "PREFECT_API_URL": cluster.prefect_api,
    }
    pid = _spawn(
        cluster,
        "prefect-server",
        "ctl",
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(PORTS["prefect"])],
        env,
    )
    wait_until(
        lambda: healthy(cluster.prefect_api + "/health"),
        "Prefect server",
        120,
        log_path(cluster, "prefect-server"),
        pid,
    )
    cluster.timings["prefect_server_s"] = round(time.monotonic() - t0, 2)


def start_s3(cluster: Cluster) -> None:
    t0 = time.monotonic()
    host = cluster.hosts["ctl"]
    pid = _spawn(cluster, "s3", "ctl", [_bin("moto_server"), "-H", host, "-p", str(PORTS["s3"])], {})
    wait_until(
        lambda: healthy(cluster.s3_endpoint + "/moto-api/"), "S3 endpoint (moto)", 60, log_path(cluster, "s3"), pid
    )
    make_bucket(cluster)
    cluster.timings["s3_s"] = round(time.monotonic() - t0, 2)


def make_bucket(cluster: Cluster) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": cluster.s3_endpoint},
    )
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)


def start_ray(cluster: Cluster) -> None:
    """`ray start --head` on head, `ray start --address=head` on each node (in parallel), each `--block` so
    the process we started owns the node's Ray processes and stopping it stops the node."""
    t0 = time.monotonic()
    ray = _bin("ray")
    cluster.ray_dir = tempfile.mkdtemp(prefix="rf-ray-")
    cluster.save()
    env = {**cluster.s3_env(), "RAY_AUTH_MODE": "disabled"}
    head = cluster.hosts["head"]
    # The GCS declares a node dead after RAY_HEALTH_CHECKS failed health checks (each 10 s timeout + 3 s period;
    # Ray's default, 5, is ~65 s). A node cut off ~30 s needs more than its outage: after the link returns, the
    # GCS's TCP connection to it sits in retransmission backoff and is reset, which cost the 5th check in the
    # link drill; a node declared dead stops its raylet for good. 10 checks tolerate an outage of ~2 min.
    head_env = {**env, "RAY_health_check_failure_threshold": str(RAY_HEALTH_CHECKS)}
    head_pid = _spawn(
        cluster,
        "ray-head",
        "head",
        [
            ray,
            "start",
            "--head",
            *RAY_COMMON,
            f"--node-ip-address={head}",
            f"--port={PORTS['ray']}",
            f"--temp-dir={cluster.ray_dir}",
            "--num-cpus=1",
            "--num-gpus=0",
            "--resources=" + json.dumps({"head": 1}),
            "--include-dashboard=true",
            f"--dashboard-host={head}",
            f"--dashboard-port={PORTS['dashboard']}",
        ],
        head_env,
    )
    wait_until(lambda: _started(cluster, "ray-head"), "Ray head", 120, log_path(cluster, "ray-head"), head_pid)
    # one node at a time: on a small machine, raylets registering while the head's dashboard starts time out
    for node in WORKER_NODES:
        start_node(cluster, node, wait_alive=False)
    wait_until(
        lambda: _alive_nodes(cluster) >= 1 + len(WORKER_NODES),
        "Ray nodes in the state API",
        60,
        log_path(cluster, "ray-head"),
    )
    cluster.timings["ray_s"] = round(time.monotonic() - t0, 2)


RAY_HEALTH_CHECKS = 10
RAY_COMMON = ["--block", "--disable-usage-stats", "--object-store-memory", str(150 * 1024 * 1024)]


def start_node(cluster: Cluster, node: str, *, wait_alive: bool = True) -> int:
    """`ray start --address=head` on worker host `node` (also what an operator does to bring a lost node back:
    it joins as a new node id with the same resources)."""
    name = f"ray-{node}"
    if name in cluster.pids and alive(cluster.pids[name]):
        stop_pid(cluster.pids[name])
    log = log_path(cluster, name)
    offset = log.stat().st_size if log.exists() else 0
    env = {**cluster.s3_env(), "RAY_AUTH_MODE": "disabled"}
    pid = _spawn(
        cluster,
        name,
        node,
        [
            _bin("ray"),
            "start",
            f"--address={cluster.ray_address}",
            *RAY_COMMON,
            f"--node-ip-address={cluster.hosts[node]}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--resources=" + json.dumps({GPU_RESOURCE: 1, node: 1}),
        ],
        env,
    )
    wait_until(lambda: _started(cluster, name, offset), f"Ray node {node}", 120, log, pid)
    if wait_alive:
        wait_until(
            lambda: cluster.hosts[node] in {n["node_ip"] for n in _nodes_or_none(cluster)},
            f"Ray node {node} in the state API",
            60,
            log,
            pid,
        )
    return pid


def raylet_pid(cluster: Cluster, node: str) -> int:
    """The raylet of worker host `node`: a child of the `ray start --block` we started there."""
    import psutil

    for child in psutil.Process(cluster.pids[f"ray-{node}"]).children(recursive=True):
        if child.name() == "raylet" or (child.cmdline()[:1] and child.cmdline()[0].endswith("/raylet")):
            return child.pid
    raise ClusterError(f"no raylet process under ray-{node} (pid {cluster.pids[f'ray-{node}']})")


def node_of_ip(cluster: Cluster, ip: str) -> str:
    """The host name (node1, ...) of a node IP."""
    return next(h for h, addr in cluster.hosts.items() if addr == ip)


def _started(cluster: Cluster, name: str, offset: int = 0) -> bool:
    """`ray start --block` prints this once the node's processes are up (after `offset` of its log: a restart)."""
    path = log_path(cluster, name)
    if not path.exists():
        return False
    with path.open("rb") as fh:
        fh.seek(offset)
        return b"Ray runtime started" in fh.read()


def _nodes_or_none(cluster: Cluster) -> list[dict[str, Any]]:
    try:
        return ray_nodes(cluster)
    except Exception:  # noqa: BLE001 - the dashboard is not up yet
        return []


def _alive_nodes(cluster: Cluster) -> int:
    return len(_nodes_or_none(cluster))


def ray_nodes(cluster: Cluster) -> list[dict[str, Any]]:
    """Alive Ray nodes through the state API (node id, IP, resources)."""
    from ray.util.state import list_nodes

    # raise_on_missing_output=False: once a node has died, the state API counts it in its total but the ALIVE
    # filter drops it, and the default (True) then raises "data truncation" on every call
    return [
        n if isinstance(n, dict) else n.__dict__
        for n in list_nodes(
            address=cluster.dashboard_url,
            filters=[("state", "=", "ALIVE")],
            detail=True,
            limit=1000,
            raise_on_missing_output=False,
        )
    ]


def register_pool(cluster: Cluster) -> None:
    """The process work pool, the five flows' `<flow>/pool` deployments on it (defaults point at this
    cluster's S3 store and Ray head), and the S3 result storage block."""
    t0 = time.monotonic()
    env = {**os.environ, **cluster.client_env(), "PREFECT_HOME": str(Path(cluster.state_dir) / "prefect-client")}
    # the deployments are flows/' business (infra never imports flows/): a process against the cluster's API
    sh(sys.executable, "-m", "rollflow.flows.cluster_pool", cluster.state_dir, env=env, timeout=180)
    cluster.timings["pool_s"] = round(time.monotonic() - t0, 2)


def start_worker(cluster: Cluster, host: str = "head", queue: str = DEFAULT_QUEUE) -> str:
    """`prefect worker start --pool --work-queue` on `host` (the Ray head by default: each flow run is a process
    there, a Ray driver on the head node, docs/cluster.md). Each worker polls one queue of the pool, so a run is
    sent to a host by its queue (`create_flow_run_from_deployment(..., work_queue_name=...)`). Returns the name
    of the worker's process in the cluster's pids."""
    t0 = time.monotonic()
    name = "prefect-worker" if host == "head" else f"prefect-worker-{host}"
    cwd = Path(cluster.state_dir) / ("worker" if host == "head" else f"worker-{host}")
    cwd.mkdir(parents=True, exist_ok=True)
    env = {
        **cluster.client_env(),
        "PREFECT_HOME": str(Path(cluster.state_dir) / name),
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    }
    argv = [_bin("prefect"), "worker", "start", "--pool", POOL, "--work-queue", queue, "--type", "process"]
    pid = _spawn(cluster, name, host, [*argv, "--name", host], env, cwd=str(cwd))
    wait_until(lambda: _worker_online(cluster, host), f"Prefect worker on {host}", 90, log_path(cluster, name), pid)
    if host == "head":
        cluster.timings["worker_s"] = round(time.monotonic() - t0, 2)
    return name


def _worker_online(cluster: Cluster, host: str) -> bool:
    req = urllib.request.Request(
        f"{cluster.prefect_api}/work_pools/{POOL}/workers/filter",
        data=b"{}",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:  # noqa: S310
            return any(w.get("status") == "ONLINE" and w.get("name") == host for w in json.loads(resp.read()))
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- up / down / status


def up(state_dir: str | Path | None = None, *, mode: str | None = None) -> Cluster:
    """Bring the whole topology up; on any failure everything started so far is torn down again."""
    t0 = time.monotonic()
    state = Path(state_dir or default_state_dir()).resolve()
    if (state / STATE_FILE).exists():
        raise ClusterError(
            f"{state / STATE_FILE} exists: a cluster is up; run `python -m rollflow.infra.cluster "
            f"down --state-dir {state}` first"
        )
    state.mkdir(parents=True, exist_ok=True)
    mode = mode or ("netns" if netns_available() else "loopback")
    base = SUBNET if mode == "netns" else LOOPBACK_SUBNET
    cluster = Cluster(str(state), mode, {h: f"{base}.{o}" for h, o in HOSTS.items()})
    cluster.save()
    try:
        if mode == "netns":
            make_network(cluster)
        start_postgres(cluster)
        start_s3(cluster)
        start_prefect_server(cluster)
        start_ray(cluster)
        register_pool(cluster)
        start_worker(cluster)
    except BaseException:
        down(state)
        raise
    cluster.up_s = round(time.monotonic() - t0, 2)
    cluster.save()
    return cluster


STOP_ORDER = ("prefect-worker", "ray-node2", "ray-node1", "ray-head", "prefect-server", "s3", "postgres")


def down(state_dir: str | Path | None = None) -> list[str]:
    """Stop every process the cluster started (by pid), delete its namespaces, bridge and database folder.
    Works from the state file; with none, still clears the namespaces and bridge of a crashed `up`."""
    state = Path(state_dir or default_state_dir()).resolve()
    stopped: list[str] = []
    cluster = None
    if (state / STATE_FILE).exists():
        cluster = Cluster.load(state)
        order = [n for n in STOP_ORDER if n in cluster.pids] + [n for n in cluster.pids if n not in STOP_ORDER]
        for name in order:
            stop_pid(cluster.pids[name])
            stopped.append(name)
    if os.geteuid() == 0 and shutil.which("ip") and (cluster is None or cluster.mode == "netns"):
        delete_network()
    if cluster is not None:
        for folder in (cluster.pg_dir, cluster.ray_dir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
        (state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def status(state_dir: str | Path | None = None) -> dict[str, Any]:
    state = Path(state_dir or default_state_dir()).resolve()
    if not (state / STATE_FILE).exists():
        return {"up": False, "state_dir": str(state)}
    cluster = Cluster.load(state)
    return {
        "up": True,
        **cluster.to_json(),
        "alive": {name: alive(pid) for name, pid in cluster.pids.items()},
        "prefect_healthy": healthy(cluster.prefect_api + "/health"),
        "ray_nodes_alive": _alive_nodes(cluster),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rollflow.infra.cluster",
        description="A Prefect + PostgreSQL + S3 + multi-node Ray cluster on one machine "
        "(network namespaces as hosts; loopback addresses without root).",
    )
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument(
        "--state-dir", default=None, help=f"where cluster.json and logs go (default {default_state_dir()})"
    )
    parser.add_argument(
        "--mode",
        choices=("netns", "loopback"),
        default=None,
        help="hosts as network namespaces (needs root) or loopback addresses (default: netns when possible)",
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            cluster = up(args.state_dir, mode=args.mode)
            print(json.dumps(cluster.to_json(), indent=2))
        elif args.action == "down":
            print("stopped: " + (", ".join(down(args.state_dir)) or "nothing was running"))
        else:
            print(json.dumps(status(args.state_dir), indent=2))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
