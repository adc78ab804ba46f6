"""Experiment tracking (issue 21): TensorBoard, MLflow and W&B (offline) with the real libraries, on CPU.

Nothing reaches the network: W&B runs offline, MLflow writes a local file store under tmp_path.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import small_config

ALL = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wb-config",
                        "WANDB_CACHE_DIR": tmp_path / "wb-cache", "WANDB_DATA_DIR": tmp_path / "wb-data",
                        "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true",
                        "WANDB_X_DISABLE_MACHINE_INFO": "true"}.items():
        monkeypatch.setenv(name, str(value))


@pytest.fixture
def problems(monkeypatch):
    """The tracking warnings of a test, in order."""
    from rollflow.flows import tracking

    seen: list[str] = []
    original = tracking.report_problem

    def record(message: str) -> None:
        seen.append(message)
        original(message)

    monkeypatch.setattr(tracking, "report_problem", record)
    return seen


def tracked_config(tmp_path, run: str, backends=ALL, **overrides):
    tracking = {"backends": backends, "wandb_mode": "offline", "project": "rollflow-test",
                "uri": str(tmp_path / "mlruns"), **overrides.pop("tracking", {})}
    overrides.setdefault("data", {"prompts_per_rollout": 8, "eval_prompts": 8})  # small: this tests logging
    return small_config(tmp_path, run=run, tracking=tracking, **overrides)


def expected_steps(cfg) -> dict[int, set[str]]:
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.tracking import numeric_metrics

    return {row["iteration"]: set(numeric_metrics(row)) for row in read_metrics(cfg)}


def tensorboard_steps(logdir: Path) -> dict[int, set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, set[str]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, set()).add(tag)
    return out


def mlflow_steps(uri: str, run_id: str) -> dict[int, list[str]]:
    """step -> keys, a key listed once per point (so a duplicate step shows up twice)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: dict[int, list[str]] = {}
    for key in client.get_run(run_id).data.metrics:
        for point in client.get_metric_history(run_id, key):
            out.setdefault(point.step, []).append(key)
    return out


def wandb_records(path: Path) -> list:
    """The records of a `.wandb` transaction log (LevelDB log format: 32 KiB blocks, 7-byte record headers,
    after a 7-byte `:W&B` file header)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_steps(folder: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for log in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(log):
            if record.WhichOneof("record_type") != "history":
                continue
            items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                     for item in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else items.get("_step")
            out.setdefault(int(step), set()).update(k for k in items if not k.startswith("_"))
    return out


# ---- fast ------------------------------------------------------------------------------------------------

def test_config_section_defaults_off_and_validates():
    from rollflow.flows.config import ConfigError, RunConfig, load_config
    from rollflow.flows.deployments import PARAMS_MODELS

    assert RunConfig().tracking.backends == []
    cfg = load_config(overrides=['tracking.backends=["mlflow","tensorboard","mlflow"]', "tracking.fatal=true"])
    assert cfg.tracking.backends == ["mlflow", "tensorboard"] and cfg.tracking.fatal
    with pytest.raises(ConfigError, match="tracking.backends"):
        load_config(overrides=['tracking.backends=["comet"]'])
    with pytest.raises(ConfigError, match="tracking.uri must not contain credentials"):
        load_config(overrides=["tracking.uri=https://user:pw@mlflow.example/"])
    assert all("tracking" in model.model_fields for model in PARAMS_MODELS.values())


def test_import_of_the_cli_loads_no_tracking_backend():
    code = ("import sys, rollflow.flows.cli, rollflow.flows.tracking, rollflow.flows.train; "
            "print([m for m in ('mlflow', 'tensorboard', 'wandb') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_schema_helpers():
    from rollflow.flows.tracking import alignment_metrics, config_params, mlflow_key, numeric_metrics
    from rollflow.flows.config import RunConfig

    row = {"iteration": 2, "rollout_id": 1, "train/loss": 0.5, "sync/parity_ok": True, "rollout_uri": "file:///x"}
    assert numeric_metrics(row) == {"rollout_id": 1.0, "train/loss": 0.5, "sync/parity_ok": 1.0}
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4" and mlflow_key("train/loss") == "train/loss"
    report = {"checks": [{"name": "one_step_update", "status": "warn", "figures": {"ppo_kl": 0.0, "note": "x"}}]}
    assert alignment_metrics(report) == {"alignment/one_step_update/status": 0.5,
                                         "alignment/one_step_update/ppo_kl": 0.0}
    params = config_params(RunConfig())
    assert params["algo.advantage_estimator"] == "grpo" and "tracking.backends" in params


def test_missing_backend_is_one_line_naming_the_extra(tmp_path, monkeypatch, problems):
    from rollflow.flows import tracking

    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    cfg = tracked_config(tmp_path, "missing", backends=["mlflow", "tensorboard"])
    tracker = tracking.start(cfg, "rl_train")
    assert [s.name for s in tracker.sinks] == ["tensorboard"]
    assert len(problems) == 1 and "pip install 'rollflow[tracking]'" in problems[0] and "'mlflow'" in problems[0]
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close()
    assert len(problems) == 1

    fatal = tracked_config(tmp_path, "missing-fatal", backends=["mlflow"], tracking={"fatal": True})
    with pytest.raises(tracking.TrackingError, match=r"rollflow\[tracking\]"):
        tracking.start(fatal, "rl_train")


def test_resume_logs_each_committed_step_once(tmp_path, problems):
    """Rows past the resume checkpoint (iteration 3 here) are not logged; after the resume they are logged
    once, to the same MLflow run."""
    from rollflow.flows import reporting, tracking

    cfg = tracked_config(tmp_path, "resume-unit", backends=["mlflow", "tensorboard"],
                         iterations=4, checkpoint_every=2)
    rows = [{"iteration": i, "rollout_id": i - 1, "train/loss": float(i), "rollout_uri": f"u{i}"} for i in (1, 2, 3)]
    reporting.write_metrics(cfg, rows)
    with tracking.start_train(cfg, 0) as tracker:  # first attempt: commits 2, dies after row 3
        tracking.log_committed(tracker, cfg, 2)
        first_id = tracker.state["mlflow_run_id"]
    reporting.truncate_metrics(cfg, 2)  # what rl_train does on resume
    with tracking.start_train(cfg, 2) as tracker:
        assert tracker.state["mlflow_run_id"] == first_id
        reporting.record_iteration(cfg, {"iteration": 3, "rollout_id": 2, "train/loss": 30.0})
        reporting.record_iteration(cfg, {"iteration": 4, "rollout_id": 3, "train/loss": 40.0})
        tracking.log_committed(tracker, cfg, 4)
    steps = mlflow_steps(tracking.mlflow_uri(cfg), first_id)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(sorted(keys) == ["rollout_id", "train/loss"] for keys in steps.values())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking.mlflow_uri(cfg))
    assert [p.value for p in client.get_metric_history(first_id, "train/loss")] == [1.0, 2.0, 30.0, 40.0]
    assert tensorboard_steps(tmp_path / "resume-unit" / "tensorboard" / "rl_train") == {
        i: {"rollout_id", "train/loss"} for i in (1, 2, 3, 4)}
    assert problems == []


# ---- end to end (Prefect + Ray) ---------------------------------------------------------------------------

@pytest.mark.slow
def test_three_iterations_to_tensorboard_mlflow_and_wandb(tmp_path, prefect_api, ray_local, offline_wandb,
                                                         problems):
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking
    from rollflow.flows.train import rl_train

    cfg = tracked_config(tmp_path, "tracked", iterations=3)
    summary = rl_train(cfg)
    assert summary["iterations"] == 3 and problems == []
    expected = expected_steps(cfg)
    assert sorted(expected) == [1, 2, 3] and "train/loss" in expected[1] and "rollout/raw_reward" in expected[1]

    assert tensorboard_steps(tmp_path / "tracked" / "tensorboard" / "rl_train") == expected

    state = json.loads((tmp_path / "tracked" / "tracking.json").read_text())
    assert state["logged_through"] == 3
    uri = tracking.mlflow_uri(cfg)
    got = mlflow_steps(uri, state["mlflow_run_id"])
    assert {step: set(keys) for step, keys in got.items()} == {
        step: {tracking.mlflow_key(k) for k in keys} for step, keys in expected.items()}
    assert all(len(keys) == len(set(keys)) for keys in got.values())  # each point once
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(state["mlflow_run_id"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["algo.advantage_estimator"] == cfg.algo.advantage_estimator
    assert run.data.params["store.root"] == str(tmp_path)
    assert run.data.tags["prefect.flow_run_id"] and run.data.tags["rollflow.checkpoints"].endswith("/checkpoints/")
    assert run.data.tags["summary.iterations"] == "3"
    assert "reward_curve.png" in [f.path for f in client.list_artifacts(run.info.run_id)]

    [wandb_run] = list((tmp_path / "tracked" / "wandb").glob("offline-run-*"))
    assert state["wandb_run_id"] in wandb_run.name
    assert wandb_steps(tmp_path / "tracked") == expected
    config = {item.key: json.loads(item.value_json) for log in wandb_run.glob("run-*.wandb")
              for record in wandb_records(log) if record.WhichOneof("record_type") == "run"
              for item in record.run.config.update}  # the config logged with the run's start
    assert config["algo.advantage_estimator"] == cfg.algo.advantage_estimator
    assert not [k for k in config if "secret" in k.lower() or "token" in k.lower()]
    assert (wandb_run / "files" / "reward_curve.png").exists()


@pytest.mark.slow
def test_kill_and_resume_keeps_one_mlflow_run_with_each_step_once(tmp_path, prefect_api, ray_local, problems):
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking
    from rollflow.flows.train import InjectedFault, rl_train

    # The first attempt dies right after iteration 2's committed checkpoint; the second resumes to 3.
    cfg = tracked_config(tmp_path, "killed", backends=["mlflow"], iterations=3, debug={"fail_after_iteration": 2})
    with pytest.raises(InjectedFault):
        rl_train(cfg)
    state = json.loads((tmp_path / "killed" / "tracking.json").read_text())
    run_id = state["mlflow_run_id"]
    uri = tracking.mlflow_uri(cfg)
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FAILED"
    assert sorted(mlflow_steps(uri, run_id)) == [1, 2]

    summary = rl_train(cfg)
    assert summary["resumed_from"] == 2
    assert json.loads((tmp_path / "killed" / "tracking.json").read_text())["mlflow_run_id"] == run_id
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("rollflow-test").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in client.get_run(run_id).data.metrics:
        assert [p.step for p in client.get_metric_history(run_id, key)] == [1, 2, 3], key
    assert problems == []


@pytest.mark.slow
def test_two_alignment_runs_give_two_points_per_check_figure(tmp_path, prefect_api, ray_local, problems):
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking
    from rollflow.flows.alignment import alignment_check

    cfg = tracked_config(tmp_path, "nightly-tr", backends=["mlflow"])
    outs = [alignment_check(cfg), alignment_check(cfg)]
    state = json.loads((tmp_path / "nightly-tr" / "alignment" / "tracking.json").read_text())
    assert state["next_step"] == 2
    client = MlflowClient(tracking_uri=tracking.mlflow_uri(cfg))
    run = client.get_run(state["mlflow_run_id"])
    assert run.info.run_name == "nightly-tr-alignment"
    names = [c["name"] for c in outs[0]["checks"]]
    metrics = set(run.data.metrics)
    assert {f"alignment/{name}/status" for name in names} <= metrics
    assert "alignment/one_step_update/ppo_kl" in metrics
    for key in metrics:
        assert [p.step for p in client.get_metric_history(run.info.run_id, key)] == [0, 1], key
    assert len([a for a in client.list_artifacts(run.info.run_id, "alignment")]) == 2  # both JSON reports
    assert problems == []


@pytest.mark.slow
def test_a_failing_sink_is_disabled_with_one_warning_and_training_completes(tmp_path, prefect_api, ray_local,
                                                                            monkeypatch, problems):
    from rollflow.flows import tracking
    from rollflow.flows.train import rl_train

    def broken(self, metrics, step):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(tracking.MlflowSink, "log", broken)
    cfg = tracked_config(tmp_path, "flaky", backends=["mlflow", "tensorboard"], iterations=2)
    summary = rl_train(cfg)
    assert summary["iterations"] == 2
    assert len(problems) == 1, problems
    assert "'mlflow'" in problems[0] and "tracking server unreachable" in problems[0] and "disabled" in problems[0]
    assert tensorboard_steps(tmp_path / "flaky" / "tensorboard" / "rl_train") == expected_steps(cfg)
