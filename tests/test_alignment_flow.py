"""`alignment_check` through a real Prefect API and real Ray actors, and its nightly deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import small_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _flow_run_states(flow_name: str) -> list[str]:
    import anyio
    from prefect import get_client

    async def read() -> list[str]:
        async with get_client() as client:
            flows = {f.id: f.name for f in await client.read_flows()}
            runs = await client.read_flow_runs()
            return [r.state.type.value for r in runs if flows.get(r.flow_id) == flow_name and r.state]

    return anyio.run(read)


def test_nightly_deployment_registers_and_its_run_publishes_the_report(tmp_path, prefect_api, ray_local):
    from prefect import get_client
    from prefect.artifacts import Artifact

    from rollflow.flows.alignment import alignment_check, register_nightly

    cfg = small_config(tmp_path, run="nightly-t")
    dep_id = register_nightly("0 2 * * *", cfg)
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("alignment_check/nightly-alignment")
    assert dep.id == dep_id
    assert len(dep.schedules) == 1 and dep.schedules[0].active
    schedule = dep.schedules[0].schedule
    assert schedule.cron == "0 2 * * *" and schedule.timezone == "UTC"
    assert dep.parameters["params"]["run"] == "nightly-t" and dep.parameters["memory_budget_mb"] is None
    assert "params" in dep.parameter_openapi_schema["properties"]  # pydantic parameters: a form in the UI

    # What a scheduled run executes: the flow with the deployment's (JSON) parameters.
    out = alignment_check(**dep.parameters)
    assert out["status"] == "pass", json.dumps(out["checks"], indent=1)[:3000]
    assert [c["status"] for c in out["checks"]] == ["pass"] * 7

    report_file = Path(out["json_path"])
    assert report_file.parent == tmp_path / "nightly-t" / "alignment"
    saved = json.loads(report_file.read_text())
    assert saved["status"] == "pass" and saved["context"]["actors"] == "nightly-t-align"
    step = {c["name"]: c for c in saved["checks"]}
    assert step["step1_logprob_equals_ref"]["figures"]["equal"] is True
    assert step["one_step_update"]["figures"]["ppo_kl"] == 0.0
    # The engine and trainer ran in their own actor processes.
    assert step["step2_load_and_memory"]["figures"]["workers_share_a_process"] is False

    markdown = Artifact.get("nightly-t-alignment")
    assert markdown is not None and markdown.type == "markdown"
    assert "**Result: PASS**" in markdown.data and str(report_file) in markdown.data
    table = Artifact.get("nightly-t-alignment-checks")
    assert table is not None and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [r["status"] for r in rows] == ["pass"] * 7
    assert "COMPLETED" in _flow_run_states("alignment_check")


def test_tiny_memory_budget_fails_the_flow_run(tmp_path, prefect_api, ray_local):
    from prefect.artifacts import Artifact

    from rollflow.flows.alignment import AlignmentFailed, alignment_check

    cfg = small_config(tmp_path, run="budget-t")
    state = alignment_check(cfg, memory_budget_mb=1.0, return_state=True)
    assert state.is_failed()
    exc = state.result(raise_on_failure=False)
    assert isinstance(exc, AlignmentFailed)
    assert "step2_load_and_memory" in str(exc) and "above the budget of 1 MB" in str(exc)
    saved = json.loads(Path(exc.path).read_text())
    assert saved["status"] == "fail"
    assert [c["name"] for c in saved["checks"] if c["status"] == "fail"] == ["step2_load_and_memory"]
    # Published before failing.
    markdown = Artifact.get("budget-t-alignment")
    assert markdown is not None and "**Result: FAIL**" in markdown.data
    assert "FAILED" in _flow_run_states("alignment_check")
    # the failing check is a Failed task of that flow run; the passing ones are Completed
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        run_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        tasks = client.read_task_runs(flow_run_filter=run_filter)
    check_states = {t.name.rsplit("-", 1)[0]: t.state.name for t in tasks if t.name.startswith("check-")}
    assert check_states["check-step2_load_and_memory"] == "Failed"
    assert check_states["check-coherence"] == "Completed" and len(check_states) == 7


def test_prefect_yaml_declares_the_nightly_deployment():
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    project = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    (dep,) = [d for d in project["deployments"] if d["name"] == "nightly-alignment-pool"]
    assert dep["schedules"] == [{"cron": "0 2 * * *", "timezone": "UTC", "active": True}]
    flow = load_flow_from_entrypoint(dep["entrypoint"])  # a module path of the installed package
    assert flow.name == "alignment_check"
    from rollflow.flows.params import AlignmentParams, to_run_config

    # the default parameters are a valid config
    assert to_run_config(AlignmentParams.model_validate(dep["parameters"]["params"])).run == "nightly"


def test_cli_serve_register_only(tmp_path, prefect_api, monkeypatch):
    import typer
    from prefect import get_client
    from typer.testing import CliRunner

    from rollflow.flows.cli.align import register

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # use the session's API, start no server
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "--register-only",
            "--drill-resume",
            "--cron",
            "30 3 * * *",
            "--set",
            f"store.root={tmp_path}",
            "--set",
            "run=cli-nightly",
        ],
    )
    assert result.exit_code == 0, result.output
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("alignment_check/nightly-alignment")
    assert dep.schedules[0].schedule.cron == "30 3 * * *" and dep.parameters["params"]["run"] == "cli-nightly"
    assert dep.parameters["resume_drill"] is True and dep.parameters["reproducibility"] is False
