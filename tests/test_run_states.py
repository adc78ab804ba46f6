"""Run states you can trust, against a real local Prefect server (its own database, a free loopback port):

- a SIGKILLed flow run process becomes `Crashed` through heartbeats + the crash-detection automation;
- a UI/API cancel of a directly-called (CLI-style) flow run ends it `Cancelled` and stops its Ray actors;
- the deployment alert automation exists after the deploy step and fires on a failed run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}


@pytest.fixture(scope="module")
def server(prefect_server):
    """The session's real Prefect server (tests/conftest.py), as this module's current API."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        yield prefect_server


def _spawn(api: str, *args: str, extra_env: dict | None = None) -> subprocess.Popen:
    from rollflow.infra.automations import heartbeat_env

    env = {
        **os.environ,
        **OFFLINE,
        **heartbeat_env(),
        "PREFECT_API_URL": api,
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        **(extra_env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.run_state_flows", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _flow_run_id(proc: subprocess.Popen, timeout: float = 90) -> tuple[str, list[str]]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the flow process ended before its run started:\n" + "".join(lines))
        lines.append(line)
        if line.startswith("FLOW_RUN_ID "):
            return line.split()[1], lines
    raise AssertionError("no flow run id:\n" + "".join(lines))


def _state(flow_run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _wait_state(flow_run_id: str, names: set[str], timeout: float) -> tuple[object, float]:
    started = time.monotonic()
    while True:
        state = _state(flow_run_id)
        if state is not None and state.name in names:
            return state, time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"flow run {flow_run_id} is {state.name if state else None} after {timeout:.0f}s")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_crash_detection_is_one_automation_by_name(server):
    from prefect.client.orchestration import get_client

    from rollflow.infra.automations import CRASH_AUTOMATION, ensure_crash_detection

    first = ensure_crash_detection()
    assert ensure_crash_detection() == first  # idempotent: one automation by name
    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name(CRASH_AUTOMATION)) == 1


def _named_actors(lines: list[str]) -> str:
    for line in lines:
        if line.startswith("ACTORS "):
            return line.split(" ", 1)[1].strip()
    raise AssertionError("no ACTORS line:\n" + "".join(lines))


def test_api_cancel_ends_cancelled_and_stops_actors(server):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    proc = _spawn(
        server, "watched", "cancel-me", "300", extra_env={"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    )
    try:
        run_id, lines = _flow_run_id(proc, timeout=120)
        time.sleep(3)  # some task runs (actor calls) going on
        assert _state(run_id).name == "Running"
        with get_client(sync_client=True) as client:  # what the UI's Cancel button sends
            result = client.set_flow_run_state(run_id, Cancelling(), force=False)
        assert result.status.value == "ACCEPT"
        asked = time.monotonic()
        state, _ = _wait_state(run_id, {"Cancelled"}, 30)
        elapsed = time.monotonic() - asked
        print(f"cancel -> Cancelled: {elapsed:.1f}s ({state.message})")
        out, _ = proc.communicate(timeout=60)
        lines += out.splitlines(keepends=True)
        assert proc.returncode == 0, "".join(lines)
        assert "FINAL CANCELLED" in "".join(lines)
        assert _named_actors(lines) == "[]"  # the run's engine and trainer are gone
        assert elapsed < 10
    finally:
        _stop(proc)


def test_nightly_alert_exists_after_deploy_and_fires(server):
    from prefect.client.orchestration import get_client

    from rollflow.flows.alignment import FLOW_NAME, NIGHTLY, nightly_parameters, register_nightly
    from rollflow.flows.config import RunConfig
    from rollflow.infra.automations import alert_name, automation_events

    cfg = RunConfig(run="nightly-test")
    deployment_id = register_nightly(cfg=cfg)  # the deploy step (`rollflow serve --register-only`)
    assert register_nightly(cfg=cfg) == deployment_id
    with get_client(sync_client=True) as client:
        [auto] = client.read_automations_by_name(alert_name(f"{FLOW_NAME}/{NIGHTLY}"))  # one, however often deployed
        assert auto.enabled
        assert auto.trigger.expect == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.Late"}
        assert str(deployment_id) in str(auto.trigger.match_related)
        # A forced-failing nightly run: a parameter the flow rejects (credentials in store.root), so the
        # run fails at parameter validation without starting Ray.
        params = nightly_parameters(cfg)
        params["params"]["store"]["root"] = "s3://key:secret@bucket/prefix"
        run = client.create_flow_run_from_deployment(deployment_id, parameters=params)
    # executed as a worker / `rollflow serve` executes a deployment's run
    env = {**os.environ, **OFFLINE, "PREFECT_API_URL": server, "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}
    # ~65 s alone, over 120 s on a loaded 2-core box, and past 300 s once beside 3 busy xdist workers (most of it
    # importing the flow's module: torch, transformers); the run fails at parameter validation whatever the wait
    done = subprocess.run(
        [str(Path(sys.executable).with_name("prefect")), "flow-run", "execute", str(run.id)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    _wait_state(str(run.id), {"Failed"}, 30)
    deadline = time.monotonic() + 30
    while True:
        events = automation_events(auto.id)
        fired = [e for e in events if e["event"] == "prefect.automation.triggered"]
        if fired:
            break
        assert time.monotonic() < deadline, f"no firing of the alert: {events}\n{done.stdout}\n{done.stderr}"
        time.sleep(1)
    assert any(str(run.id) in json.dumps(e) for e in fired), fired


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, under_way",
    [
        ("train", "metrics.jsonl"),  # rl_train: a committed iteration
        ("rollout", "rollouts/train/000000/manifest.json"),  # rollout_only: a committed rollout
    ],
)
def test_ui_cancel_of_a_cli_run_ends_cancelled_and_stops_its_actors(server, ray_local, tmp_path, command, under_way):
    """The real thing: `rollflow train` (or `rollflow rollout`) in a terminal, Cancel in the UI. The CLI joins
    the test's Ray cluster (ray.address), so its detached actors would outlive the process unless the cancel
    stopped them."""
    import ray
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    from rollflow.infra.automations import heartbeat_env
    from rollflow.infra.workers import NAMESPACE

    address = ray_local
    env = {**os.environ, **OFFLINE, **heartbeat_env(), "PREFECT_API_URL": server, "RAY_AUTH_MODE": "disabled"}
    argv = [
        str(Path(sys.executable).with_name("rollflow")),
        command,
        "--set",
        "run=cancel-cli",
        "--set",
        "iterations=200",
        "--set",
        f"store.root={tmp_path}",
        "--set",
        f"ray.address={address}",
        "--set",
        "data.prompts_per_rollout=8",
        "--set",
        "rollout.n_samples_per_prompt=2",
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def run_actors() -> list[str]:
        return [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith("cancel-cli:")
        ]

    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "cancel-cli" / under_way).exists():  # the run's loop is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(1)
        assert run_actors()
        with get_client(sync_client=True) as client:
            name = "cancel-cli" if command == "train" else f"cancel-cli/{command}"  # flows/prefect_ops/naming.py
            [run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            assert run.state.name == "Running"
            client.set_flow_run_state(run.id, Cancelling(), force=False)  # the UI's Cancel button
        asked = time.monotonic()
        _wait_state(str(run.id), {"Cancelled"}, 30)
        elapsed = time.monotonic() - asked
        out, _ = proc.communicate(timeout=60)
        assert "the run was cancelled" in out and proc.returncode == 1, out
        assert elapsed < 10, elapsed
        deadline = time.monotonic() + 10
        while run_actors():  # a kill frees the name shortly after
            assert time.monotonic() < deadline, run_actors()
            time.sleep(0.5)
    finally:
        _stop(proc)


API_RUN = """
import sys

import prefect  # before rollflow: Prefect's settings are built with its own heartbeat default (the case this covers)

from rollflow.flows.config import RunConfig
from prefect.settings import get_current_settings

from rollflow.flows.train import rl_train

print("PREFECT_HEARTBEAT_FREQUENCY", get_current_settings().flows.heartbeat_frequency, flush=True)
root, address = sys.argv[1], sys.argv[2]
rl_train(RunConfig.model_validate({
    "run": "crash-api", "iterations": 200, "store": {"root": root}, "ray": {"address": address},
    "data": {"prompts_per_rollout": 8}, "rollout": {"n_samples_per_prompt": 2}, "debug": {"slow_train_s": 15},
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_sigkill_of_rollflow_train_and_of_a_python_api_run_ends_their_runs_crashed(server, ray_local, tmp_path):
    """The product path: `rollflow train` in a terminal, and rl_train called from a script that imported prefect
    first (so Prefect beats at its own default, too rarely for the crash window); both stay Running past the
    crash window while healthy, then both processes are SIGKILLed: the run and its running iteration end
    Crashed through the crash-detection automation, nobody acting. Another team's flow on the same server,
    beating at Prefect's own 30 s and killed at the same moment, is left alone by rollflow's automation."""
    import ray
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from rollflow.infra.automations import CRASH_AFTER_S
    from rollflow.infra.workers import NAMESPACE

    address = ray_local
    env = {**os.environ, **OFFLINE, "PREFECT_API_URL": server, "RAY_AUTH_MODE": "disabled"}
    env.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)  # neither child gets heartbeats from the test
    cli = [str(Path(sys.executable).with_name("rollflow")), "train"]
    for item in (
        "run=crash-cli",
        "iterations=200",
        f"store.root={tmp_path}",
        f"ray.address={address}",
        "data.prompts_per_rollout=8",
        "rollout.n_samples_per_prompt=2",
        # each train call idles 15 s (ticking its progress): the runs stay healthy and busy through the crash
        # window without two training loops taking the host's CPUs for minutes
        "debug.slow_train_s=15",
    ):
        cli += ["--set", item]
    procs = {
        "crash-cli": subprocess.Popen(
            cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ),
        "crash-api": subprocess.Popen(
            [sys.executable, "-c", API_RUN, str(tmp_path), address],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ),
    }
    other = _spawn(server, "plain", "600")
    try:
        other_id = _flow_run_id(other)[0]
        deadline = time.monotonic() + 480  # 240 s passed once beside 3 busy xdist workers on 2 cores
        for run, proc in procs.items():  # each run's loop is under way: an iteration committed
            while not (tmp_path / run / "metrics.jsonl").exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(1)

        # healthy runs outlive the crash window: a run beating only at Prefect 3.9's default (180 s) would be
        # marked Crashed CRASH_AFTER_S after its first beat while it still trains (the bug this covers)
        def parents() -> dict:
            with get_client(sync_client=True) as client:
                return {
                    run: client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run])))[0]
                    for run in procs
                }

        # the first beat goes out when a run starts; the automation is evaluated every few seconds
        latest_start = max(p.start_time.timestamp() for p in parents().values())
        time.sleep(max(0.0, latest_start + CRASH_AFTER_S + 40 - time.time()))
        for run, parent in parents().items():
            assert parent.state.name == "Running", (run, parent.state.name, parent.state.message)
        assert _state(other_id).name == "Running"
        for proc in [*procs.values(), other]:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        killed = time.monotonic()
        out = procs["crash-api"].stdout.read()
        # Prefect beats rarely (or not) in the API run: its 30 s beats are rollflow's own
        assert "PREFECT_HEARTBEAT_FREQUENCY 30" not in out, out
        with get_client(sync_client=True) as client:
            runs = {
                run: client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run)))
                for run in procs
            }
        for run, found in runs.items():
            running = [r for r in found if r.state and r.state.name == "Running"]
            names = sorted(r.name for r in running)
            assert run in names, (run, names)  # the run, and its iteration when the kill landed inside one
            for flow_run in running:
                state, _ = _wait_state(str(flow_run.id), {"Crashed"}, CRASH_AFTER_S + 90 - (time.monotonic() - killed))
                assert "heartbeat" in (state.message or ""), state.message
        print(f"both runs and their iterations Crashed {time.monotonic() - killed:.0f}s after the SIGKILL")
        # the other team's run went silent at the same moment, past the crash window now: it stays Running
        time.sleep(max(0.0, killed + CRASH_AFTER_S + 10 - time.monotonic()))
        assert _state(other_id).name == "Running"
    finally:
        _stop(other)
        for proc in procs.values():
            _stop(proc)
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == NAMESPACE and actor["name"].split(":")[0] in procs:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
