"""Every flow a deployment, against a real Prefect server and a real `rollflow worker` process:

- the five flows are listed as deployments, each with a form of only the RunConfig sections it reads;
- a replay_train run created from its deployment (the UI's "Run" call) completes, and an identical replay
  under another run name is Cached without starting Ray;
- a failed rl_train deployment run retried through the UI's Retry call resumes in the same flow run,
  regenerates no rollout, and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {"rl_train", "rollout_only", "replay_train", "alignment_check", "ima_bisect"}
# small enough for the 2-core CI box; the same shape in every run so results are comparable
SMALL = {
    "data": {"prompts_per_rollout": 8},
    "rollout": {"n_samples_per_prompt": 2, "threads": 1},
    "train": {"threads": 1},
}


def test_each_flow_has_a_form_of_what_it_reads():
    from prefect.utilities.callables import parameter_schema

    from rollflow.flows.config import RunConfig
    from rollflow.flows.params import PARAMS_MODELS, to_run_config
    from rollflow.flows.prefect_ops.deployments import entry_flows

    flows = entry_flows()
    assert set(flows) == FLOWS
    all_fields = set(RunConfig.model_fields)
    for name, entry in flows.items():
        assert entry.name == name  # the UI groups deployment runs with CLI runs of the same flow
        schema = parameter_schema(entry.fn).model_dump()
        assert "params" in schema["properties"]
        # that each form holds what its flow reads: tests/test_deployment_forms.py
        assert set(PARAMS_MODELS[name].model_fields) < all_fields
        # defaults of every form are a valid RunConfig
        assert isinstance(to_run_config(PARAMS_MODELS[name]()), RunConfig)
    assert "train" not in PARAMS_MODELS["rollout_only"].model_fields


def test_nightly_deployment_carries_the_reproducibility_and_drill_options_into_its_form():
    """`rollflow serve --repro`: the scheduled runs' parameters switch the gate on, and Prefect's own schema of
    alignment_check validates them (the UI form accepts what the schedule sends)."""
    from prefect.utilities.callables import parameter_schema

    from rollflow.flows.alignment import alignment_check, nightly_deployment

    schema = parameter_schema(alignment_check.fn).model_dump()
    assert schema["properties"]["reproducibility"]["default"] is False
    for repro in (False, True):
        params = nightly_deployment(reproducibility=repro).parameters
        assert params["reproducibility"] is repro
        assert alignment_check.validate_parameters(params)["reproducibility"] is repro
    assert schema["properties"]["resume_drill"]["default"] is False
    for drill in (False, True):  # `rollflow serve --drill-resume`
        params = nightly_deployment(resume_drill=drill).parameters
        assert params["resume_drill"] is drill
        assert alignment_check.validate_parameters(params)["resume_drill"] is drill


def test_prefect_yaml_and_worker_use_distinct_names():
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    from rollflow.flows.prefect_ops.deployments import NIGHTLY, POOL, SERVED

    project = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    deps = project["deployments"]
    assert {d["entrypoint"].rsplit(":", 1)[1] for d in deps} == FLOWS
    pool_names = {(d["entrypoint"].rsplit(":", 1)[1], d["name"]) for d in deps}
    served = {(f, SERVED) for f in FLOWS} | {("alignment_check", NIGHTLY)}
    assert not pool_names & served  # the two routes never overwrite each other
    assert {(f, POOL) for f in FLOWS} <= pool_names
    for dep in deps:
        flow = load_flow_from_entrypoint(dep["entrypoint"])
        assert flow.name == dep["entrypoint"].rsplit(":", 1)[1]


# ---- a real worker ----------------------------------------------------------------------------------------


def _start_worker(api: str, cwd: Path, *args: str) -> subprocess.Popen:
    from rollflow.infra.automations import heartbeat_env

    env = {
        **os.environ,
        **heartbeat_env(),
        "PREFECT_API_URL": api,
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "RAY_AUTH_MODE": "disabled",
    }
    log = open(cwd / "worker.log", "ab")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("rollflow")), "worker", *args],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def _stop_worker(proc: subprocess.Popen) -> None:
    """What a service manager does: SIGINT (the unit's KillSignal), then wait."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(prefect_server, tmp_path_factory):
    """`rollflow worker` serving every flow from one process, against the session's Prefect server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    cwd = tmp_path_factory.mktemp("worker")
    proc = _start_worker(prefect_server, cwd, "--nightly-cron", "")
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server}):
            _wait_deployments(proc, cwd / "worker.log")
            yield cwd
    finally:
        _stop_worker(proc)


def _wait_deployments(proc, log_path: Path, timeout: float = 120, also: tuple = ()) -> None:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            names = {(client.read_flow(d.flow_id).name, d.name) for d in client.read_deployments() if not d.paused}
        if {(f, "worker") for f in FLOWS} | set(also) <= names:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"worker did not register its deployments: {names}\n{log_path.read_text()[-3000:]}")
        time.sleep(1)


def _run(flow_name: str, parameters: dict, timeout: float = 240):
    """Create a run from the deployment (the UI's "Run" call) and wait until it is final."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"{flow_name}/worker")
        run = client.create_flow_run_from_deployment(dep.id, parameters=parameters)
    return _wait_final(run.id, timeout)


def _wait_final(flow_run_id, timeout: float):
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {run.name} still {run.state.name if run.state else None}")
            time.sleep(1)


def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _logs(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(entry.message for entry in logs)


def _params(flow_name: str, run: str, root: Path, **extra) -> dict:
    """A flow's form: only the sections it has (the server validates runs against the deployment's schema)."""
    from rollflow.flows.params import SECTIONS

    small = {k: v for k, v in SMALL.items() if k in SECTIONS[flow_name]}
    return {"run": run, "store": {"root": str(root)}, **small, **extra}


@pytest.mark.slow
def test_replay_deployment_runs_then_hits_cache_across_run_names(worker, tmp_path):
    root = tmp_path / "runs"
    src = _run("rollout_only", {"params": _params("rollout_only", "src", root, iterations=2)})
    assert src.state.name == "Completed", _logs(src.id)

    first = _run(
        "replay_train",
        {"params": _params("replay_train", "replay-a", root), "rollout_ids": [0, 1], "source_run": "src"},
    )
    assert first.state.name == "Completed", _logs(first.id)
    names = [t.name for t in _task_runs(first.id)]
    assert any(n.startswith("start-workers") for n in names)
    assert sum(n.startswith("replay-train") for n in names) == 2

    again = _run(
        "replay_train",
        {"params": _params("replay_train", "replay-b", root), "rollout_ids": [0, 1], "source_run": "src"},
    )
    assert again.state.name == "Completed", _logs(again.id)
    tasks = _task_runs(again.id)
    replays = [t for t in tasks if t.name.startswith("replay-train")]
    assert len(replays) == 2 and all(t.state.name == "Cached" for t in replays)
    assert not any(t.name.startswith("start-workers") for t in tasks)  # no Ray, no trainer
    assert {"run:replay-b", "mode:replay"} <= set(again.tags)  # a UI-created run is tagged like a CLI run


def _weights(root: Path, run: str, iteration: int) -> dict:
    import torch

    from rollflow.tasks.train.checkpoint import load_checkpoint

    return torch.load(io.BytesIO(load_checkpoint(str(root), run, iteration)), map_location="cpu", weights_only=True)[
        "model"
    ]


def _manifests(root: Path, run: str) -> dict:
    out = {}
    for path in sorted((root / run / "rollouts").rglob("manifest.json")):
        out[str(path.relative_to(root))] = (path.stat().st_mtime_ns, path.read_bytes())
    return out


@pytest.mark.slow
def test_failed_rl_train_retried_from_ui_resumes_in_the_same_run(worker, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    # An async run with a queue two rollouts deep (issue 38): the UI's Retry resumes the queue as committed.
    root, queue = tmp_path / "runs", {"max_staleness": 2}
    failed = _run(
        "rl_train",
        {"params": _params("rl_train", "retry", root, iterations=3, debug={"fail_after_iteration": 2}, pipeline=queue)},
    )
    assert failed.state.name == "Failed", _logs(failed.id)
    assert failed.name == "retry", _logs(failed.id)  # flow runs are named after the rollflow run
    before = _manifests(root, "retry")
    # rollouts 0-2: the queue (1 and 2, from weights 0) was committed beside train 0, before the failure
    assert sorted(Path(k).parent.name for k in before) == ["000000", "000001", "000002"], (
        sorted(str(p) for p in tmp_path.rglob("*"))[:60],
        failed.run_count,
        failed.empirical_policy,
    )

    with get_client(sync_client=True) as client:  # the UI's Retry button
        client.set_flow_run_state(failed.id, AwaitingRetry(message="Retry from the UI"), force=True)
    retried = _wait_final(failed.id, 240)
    assert retried.state.name == "Completed", _logs(failed.id)
    assert retried.run_count == 2
    assert {"run:retry", "mode:train"} <= set(retried.tags)
    logs = _logs(failed.id)
    assert "resumes from checkpoint 2" in logs
    after = _manifests(root, "retry")
    assert {k: v for k, v in after.items() if k in before} == before  # no rollout regenerated
    assert len(after) == 3

    reference = _run("rl_train", {"params": _params("rl_train", "straight", root, iterations=3, pipeline=queue)})
    assert reference.state.name == "Completed", _logs(reference.id)
    resumed, straight = _weights(root, "retry", 3), _weights(root, "straight", 3)
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert (resumed[name] == straight[name]).all(), name


@pytest.mark.slow
def test_nightly_schedule_and_alert_survive_a_worker_restart(prefect_server, tmp_path):
    """Stopping `rollflow worker` pauses its deployments (Prefect's serve); the restarted service brings the
    nightly schedule back, and the alert automation exists from the first start on (one, however often)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rollflow.flows.prefect_ops.deployments import NIGHTLY
    from rollflow.infra.automations import alert_name

    nightly = ("alignment_check", NIGHTLY)
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        for _attempt in range(2):  # first start, then the restart a service manager does
            proc = _start_worker(prefect_server, tmp_path, "--nightly-cron", "15 3 * * *")
            try:
                _wait_deployments(proc, tmp_path / "worker.log", also=(nightly,))
                with get_client(sync_client=True) as client:
                    dep = client.read_deployment_by_name("alignment_check/" + NIGHTLY)
                    assert not dep.paused
                    assert [s.schedule.cron for s in dep.schedules if s.active] == ["15 3 * * *"]
                    # the alert is created right after its deployment (it names the deployment's id)
                    deadline = time.monotonic() + 30
                    while not (autos := client.read_automations_by_name(alert_name("alignment_check/" + NIGHTLY))):
                        assert time.monotonic() < deadline, "no alert automation for the nightly deployment"
                        time.sleep(0.5)
                    assert len(autos) == 1 and autos[0].enabled
                    assert str(dep.id) in str(autos[0].trigger.match_related)
            finally:
                _stop_worker(proc)


def test_automations_command_after_prefect_deploy(prefect_server, monkeypatch):
    """The pool route (`prefect deploy` runs none of our code) gets its crash detection and nightly alert
    from `rollflow automations`; a deployment that is not registered is one clear line, exit 2."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from rollflow.flows.alignment import alignment_check
    from rollflow.flows.cli import app
    from rollflow.flows.prefect_ops.deployments import NIGHTLY_POOL
    from rollflow.infra.automations import CRASH_AUTOMATION, alert_name

    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    name = f"alignment_check/{NIGHTLY_POOL}"
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        missing = CliRunner().invoke(app, ["automations", "--alert-on", "alignment_check/not-deployed"])
        assert missing.exit_code == 2 and "'alignment_check/not-deployed' is not registered" in missing.output
        dep_id = alignment_check.to_deployment(name=NIGHTLY_POOL).apply()  # what `prefect deploy` registers
        for _ in range(2):  # idempotent
            done = CliRunner().invoke(app, ["automations"])
            assert done.exit_code == 0, done.output
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name(CRASH_AUTOMATION)) == 1
            [alert] = client.read_automations_by_name(alert_name(name))
        assert str(dep_id) in str(alert.trigger.match_related)
