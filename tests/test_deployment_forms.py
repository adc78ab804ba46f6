"""Every RunConfig field a deployable flow reads reaches a run created through its deployment, or `--submit`
refuses it in one line (issue 36).

The set of fields each flow reads is not taken from flows/params.py (SECTIONS is what is under test): it is
recorded while the flow's local code path (what `rollflow train / rollout / replay / align / bisect` runs in
this process) runs for real, with every read of a RunConfig field by rollflow code counted. Each of those
fields is then set to a non-default value and sent through the CLI's real submit path to a real Prefect API;
the run the API created must hold that value (its form, or its flow-run policy), or the CLI must refuse it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "iterations": 1,
    "data": {"prompts_per_rollout": 8, "eval_prompts": 8},
    "rollout": {"n_samples_per_prompt": 2, "threads": 1},
    "train": {"threads": 1, "micro_batch_size": 16},
}
# the command (and preflight mode) of each flow, as the CLI names them
COMMANDS = {
    "rl_train": "train",
    "rollout_only": "rollout",
    "replay_train": "replay",
    "alignment_check": "align",
    "ima_bisect": "bisect",
}
# A non-default value of every RunConfig field (--set overrides, space-separated); a section gets one field
# of it changed.
NON_DEFAULT = {
    "run": "run=probe-run",
    "iterations": "iterations=3",
    "checkpoint_every": "checkpoint_every=2",
    "eval_every": "eval_every=2",
    "resume": "resume=false",
    "retries": "retries=2",
    "timeout_s": "timeout_s=600",
    "resume_from": "resume_from=1",
    "model": f"model.path={ROOT / 'tasks' / 'model' / 'builtin' / 'addition-sft'}",
    "data": "data.prompts_per_rollout=7",
    "rollout": "rollout.temperature=0.5",
    "algo": "algo.eps_clip=0.3",
    "train": "train.lr=0.001",
    "store": "store.shared_filesystem=true",
    "ray": "ray.num_cpus=1",
    "placement": "placement=colocate",
    "offload": "placement=colocate offload=true",
    "resources": "resources.cpus_per_bundle=2",
    "debug": "debug.slow_train_s=0.5",
    "tracking": "tracking.project=probe",
    "watchdog": "watchdog.stall_s=300",
    "pipeline": "pipeline.dynamic_sampling.max_tries=3",
}


@pytest.fixture
def record_reads(monkeypatch):
    """Count every read of a RunConfig field made by rollflow code (not by Prefect or pydantic serialising it),
    on any RunConfig, including those a flow rebuilds from a dump. Preflight is left out: it runs on the
    submitting side as well, so what it reads is honoured on either route."""
    from rollflow.flows.config import RunConfig

    fields = frozenset(RunConfig.model_fields)
    reads: set[str] = set()

    def in_preflight(frame) -> bool:
        while frame is not None:
            if frame.f_globals.get("__name__") == "rollflow.flows.preflight":
                return True
            frame = frame.f_back
        return False

    def recording(self, name):
        if name in fields and name not in reads:
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__", "").startswith("rollflow.") and not in_preflight(caller):
                reads.add(name)
        return object.__getattribute__(self, name)

    monkeypatch.setattr(RunConfig, "__getattribute__", recording)
    return reads


def _run_locally(flow_name: str, cfg, tmp_path: Path) -> None:
    """The code path of the flow's local command, for real (Prefect API, Ray, workers, subprocesses)."""
    from rollflow.flows import debug
    from rollflow.flows.cli import align, bisect, root

    if flow_name == "rl_train":
        root.run_training(cfg)
    elif flow_name == "rollout_only":
        root.run_flow(cfg, debug.rollout_only, "rollout", rollout_ids=[0])
    elif flow_name == "replay_train":
        root.run_flow(
            cfg,
            debug.replay_train,
            "replay",
            preflight_kwargs={"rollout_ids": [0], "source_run": "src"},
            rollout_ids=[0],
            source_run="src",
        )
    elif flow_name == "alignment_check":
        align.run_align(cfg)
    else:
        bisect._bisect(cfg, False, dict(crash_when=None, timeout_s=120, coredump=False, fault=None, parallel=2))


def _config(tmp_path: Path, flow_name: str, *sets: str):
    from rollflow.flows.config_loading import load_config

    cfg = small_config(tmp_path / "runs", run=flow_name.replace("_", "-"), **SMALL)
    base = cfg.model_dump(mode="json")
    mode = {"rollout_only": "debug.rollout_only=true", "replay_train": "debug.train_only=true"}.get(flow_name)
    return load_config(None, [*sets, *([mode] if mode else [])], base=base)


def _apply_deployments() -> None:
    """The five `<flow>/worker` deployments as `rollflow worker` registers them (no worker runs them here)."""
    from rollflow.flows.prefect_ops.deployments import served_deployments

    for deployment in served_deployments(nightly_cron=None):
        deployment.apply()


def _latest_run(flow_name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"{flow_name}/worker")
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        )
    return runs[0].id if runs else None


def _received(flow_name: str, run):
    """The RunConfig the submitted run would run, rebuilt from what the API holds for it, the way the flow
    rebuilds it (its form over RunConfig's defaults, then its own debug arguments)."""
    from rollflow.flows.params import PARAMS_MODELS

    params = PARAMS_MODELS[flow_name].model_validate(run.parameters["params"])
    args = run.parameters
    if flow_name == "rollout_only":
        return params.run_config(mode="rollout_only", save_debug_rollout_data=args.get("save_debug_rollout_data"))
    if flow_name == "replay_train":
        return params.run_config(
            mode="train_only",
            load_debug_rollout_data=args.get("load_debug_rollout_data"),
            load_debug_rollout_data_subsample=args.get("subsample"),
            dump_details=args.get("dump_details"),
        )
    return params.run_config()


# the flows whose command has `--submit` (`rollflow align` and `rollflow bisect` run here only)
SUBMITS = {"rl_train", "rollout_only", "replay_train"}
# the flow-run settings Prefect keeps outside the parameters, as the created run holds them
RUN_POLICY = {"retries": lambda run: run.empirical_policy.retries}


def _sent_or_refused(flow_name: str, field: str, tmp_path: Path, capsys) -> str | None:
    """None when a non-default `field` reaches the run created by `--submit`, else what went wrong."""
    import typer
    from prefect.client.orchestration import get_client

    from rollflow.flows.cli.root import submit_run
    from rollflow.flows.config import RunConfig

    cfg = _config(tmp_path, flow_name, *NON_DEFAULT[field].split(" "))
    value = getattr(cfg, field)
    if value == RunConfig.model_fields[field].get_default(call_default_factory=True):
        return f"the probe {NON_DEFAULT[field]!r} is RunConfig's default"
    before = _latest_run(flow_name)
    capsys.readouterr()
    try:
        submit_run(cfg, flow_name, COMMANDS[flow_name], False)
    except typer.Exit as done:
        err = capsys.readouterr().err.strip()
        after = _latest_run(flow_name)
        if done.exit_code == 2 and len(err.splitlines()) == 1 and field in err and after == before:
            return None  # refused in one line that names the field, and nothing was created
        return f"--submit with {NON_DEFAULT[field]!r} ended {done.exit_code}: {err!r}"
    run_id = _latest_run(flow_name)
    assert run_id is not None and run_id != before
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    if field in RUN_POLICY:
        got = RUN_POLICY[field](run)
    else:
        got = getattr(_received(flow_name, run), field)
    return None if got == value else f"sent {field}={value!r}, the submitted run got {got!r}"


@pytest.mark.slow
@pytest.mark.parametrize("flow_name", list(COMMANDS))
def test_every_field_a_flow_reads_reaches_its_submitted_run_or_is_refused(
    flow_name, tmp_path, prefect_api, ray_local, record_reads, monkeypatch, capsys
):
    from rollflow.flows.params import PARAMS_MODELS

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    if flow_name == "replay_train":
        src = small_config(tmp_path / "runs", run="src", debug={"rollout_only": True}, **SMALL)
        from rollflow.flows import debug

        debug.rollout_only(src, rollout_ids=[0])
    cfg = _config(tmp_path, flow_name)
    record_reads.clear()
    _run_locally(flow_name, cfg, tmp_path)
    reads = set(record_reads)
    assert {"run", "store", "model"} <= reads  # the recorder saw the flow work

    if flow_name not in SUBMITS:
        # no `--submit` route: a UI or scheduled run gets only its form
        missing = sorted(reads - set(PARAMS_MODELS[flow_name].model_fields))
        assert not missing, f"{flow_name} reads {missing}, which its deployment form does not carry"
        return
    _apply_deployments()
    problems = {field: _sent_or_refused(flow_name, field, tmp_path, capsys) for field in sorted(reads)}
    problems = {k: v for k, v in problems.items() if v is not None}
    assert not problems, f"{flow_name}: fields it reads that --submit loses: {problems}"
