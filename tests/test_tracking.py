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
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": tmp_path / "wb-config",
        "WANDB_CACHE_DIR": tmp_path / "wb-cache",
        "WANDB_DATA_DIR": tmp_path / "wb-data",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
    }.items():
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
    tracking = {
        "backends": backends,
        "wandb_mode": "offline",
        "project": "rollflow-test",
        "uri": str(tmp_path / "mlruns"),
        **overrides.pop("tracking", {}),
    }
    overrides.setdefault("data", {"prompts_per_rollout": 8, "eval_prompts": 8})  # small: this tests logging
    overrides.setdefault("train", {"num_steps_per_rollout": 2})  # two optimizer steps per iteration
    return small_config(tmp_path, run=run, tracking=tracking, **overrides)


def expected_steps(cfg) -> dict[int, set[str]]:
    """step -> keys every sink should hold: metrics.jsonl's rows at step = iteration, and train_steps.jsonl's
    `train_step/*` at step = global optimizer step (distinct keys, so the two axes share the dict)."""
    from rollflow.flows.reporting import read_metrics, read_train_steps
    from rollflow.flows.tracking import numeric_metrics

    out = {row["iteration"]: set(numeric_metrics(row)) for row in read_metrics(cfg)}
    for row in read_train_steps(cfg):
        out.setdefault(row["step"], set()).update(k for k in row if k.startswith("train_step/"))
    return out


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
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
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


def wandb_steps(folder: Path, pattern: str = "wandb/offline-run-*/run-*.wandb") -> dict[int, set[str]]:
    """step -> keys, the step being each row's x-axis metric (`step` for rows, `train_step/step` for optimizer
    steps: flows/tracking.py WandbSink), not W&B's own row counter `_step`."""
    from rollflow.flows.tracking import ROW_AXIS, STEP_AXIS

    out: dict[int, set[str]] = {}
    for log in sorted(folder.glob(pattern)):
        for record in wandb_records(log):
            if record.WhichOneof("record_type") != "history":
                continue
            items = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item
            }
            step = items[STEP_AXIS] if STEP_AXIS in items else items[ROW_AXIS]
            out.setdefault(int(step), set()).update(
                k for k in items if not k.startswith("_") and k not in (ROW_AXIS, STEP_AXIS)
            )
    return out


# ---- fast ------------------------------------------------------------------------------------------------


def test_config_section_defaults_off_and_validates():
    from rollflow.flows.config import RunConfig
    from rollflow.flows.config_loading import ConfigError, load_config
    from rollflow.flows.params import PARAMS_MODELS

    assert RunConfig().tracking.backends == []
    cfg = load_config(overrides=['tracking.backends=["mlflow","tensorboard","mlflow"]', "tracking.fatal=true"])
    assert cfg.tracking.backends == ["mlflow", "tensorboard"] and cfg.tracking.fatal
    with pytest.raises(ConfigError, match="tracking.backends"):
        load_config(overrides=['tracking.backends=["comet"]'])
    with pytest.raises(ConfigError, match="tracking.uri must not contain credentials"):
        load_config(overrides=["tracking.uri=https://user:pw@mlflow.example/"])
    assert all("tracking" in model.model_fields for model in PARAMS_MODELS.values())


def test_import_of_the_cli_loads_no_tracking_backend():
    code = (
        "import sys, rollflow.flows.cli, rollflow.flows.tracking, rollflow.flows.train; "
        "print([m for m in ('mlflow', 'tensorboard', 'wandb') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_schema_helpers():
    from rollflow.flows.config import RunConfig
    from rollflow.flows.tracking import alignment_metrics, config_params, mlflow_key, numeric_metrics

    row = {"iteration": 2, "rollout_id": 1, "train/loss": 0.5, "sync/parity_ok": True, "rollout_uri": "file:///x"}
    assert numeric_metrics(row) == {"rollout_id": 1.0, "train/loss": 0.5, "sync/parity_ok": 1.0}
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4" and mlflow_key("train/loss") == "train/loss"
    report = {"checks": [{"name": "one_step_update", "status": "warn", "figures": {"ppo_kl": 0.0, "note": "x"}}]}
    assert alignment_metrics(report) == {
        "alignment/one_step_update/status": 0.5,
        "alignment/one_step_update/ppo_kl": 0.0,
    }
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


def test_file_uri_is_the_local_sqlite_store_and_mlflow_reads_the_metrics_back(tmp_path, problems):
    """`file:///.../mlruns` (MLflow's usual local form) is the SQLite store a plain folder gets: MLflow 3 refuses
    its file store, which left the run untracked after one warning."""
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking

    folder = tmp_path / "my mlruns"  # a space: the URI's %20 is the folder's space
    cfg = tracked_config(tmp_path, "file-uri", backends=["mlflow"], tracking={"uri": folder.as_uri()})
    plain = tracked_config(tmp_path, "file-uri", backends=["mlflow"], tracking={"uri": str(folder)})
    assert tracking.mlflow_uri(cfg) == tracking.mlflow_uri(plain) == f"sqlite:///{folder / 'mlflow.db'}"
    with tracking.start(cfg, "rl_train") as tracker:
        tracker.log({"train/loss": 0.5, "eval/pass@4": 1.0}, 1)
        tracker.log({"train/loss": 0.25}, 2)
        run_id = tracker.state["mlflow_run_id"]
    assert problems == []
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    assert [(p.step, p.value) for p in client.get_metric_history(run_id, "train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [p.value for p in client.get_metric_history(run_id, "eval/pass_at_4")] == [1.0]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["tracking.uri"] == folder.as_uri()


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_mlflow_setup_that_cannot_work_is_one_line_before_anything_starts(tmp_path, problems):
    """An unreachable server (MLflow's client would retry it for minutes) or a store MLflow refuses: one warning
    at start and the other sinks go on; with tracking.fatal one error, from the CLI's preflight before Prefect
    or Ray start, and from the flow's tracker start before any worker."""
    import time

    from rollflow.flows import tracking
    from rollflow.flows.input_errors import PreflightError
    from rollflow.flows.preflight import preflight

    port = closed_port()
    server = {"uri": f"http://127.0.0.1:{port}"}
    cfg = tracked_config(tmp_path, "unreachable", backends=["mlflow", "tensorboard"], tracking=server)
    began = time.monotonic()
    tracker = tracking.start(cfg, "rl_train")
    assert time.monotonic() - began < 30
    assert [s.name for s in tracker.sinks] == ["tensorboard"]
    assert len(problems) == 1 and f"127.0.0.1:{port} is unreachable" in problems[0] and "\n" not in problems[0]
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close()
    assert len(problems) == 1
    [events] = (tmp_path / "unreachable" / "tensorboard" / "rl_train").iterdir()  # one folder per start
    assert tensorboard_steps(events) == {1: {"train/loss"}}

    refused = tracked_config(tmp_path, "refused", backends=["mlflow"], tracking={"uri": "nosuchscheme://x"})
    assert tracking.start(refused, "rl_train").sinks == []
    assert len(problems) == 2 and "refuses the tracking store nosuchscheme://x" in problems[1]

    fatal = tracked_config(tmp_path, "unreachable-fatal", backends=["mlflow"], tracking={**server, "fatal": True})
    with pytest.raises(tracking.TrackingError, match=f"127.0.0.1:{port} is unreachable"):
        tracking.start(fatal, "rl_train")
    with pytest.raises(PreflightError, match=r"tracking\.uri=.*unreachable.*tracking\.fatal=false") as err:
        preflight(fatal, "train")
    assert "\n" not in str(err.value)
    preflight(cfg, "train")  # not fatal: the flow warns instead (the warning above), the command goes on
    assert len(problems) == 2


def test_resume_logs_each_committed_step_once(tmp_path, problems):
    """Rows past the resume checkpoint (iteration 3 here) are not logged; after the resume they are logged
    once, to the same MLflow run."""
    from rollflow.flows import reporting, tracking

    cfg = tracked_config(tmp_path, "resume-unit", backends=["mlflow", "tensorboard"], iterations=4, checkpoint_every=2)
    rows = [{"iteration": i, "rollout_id": i - 1, "train/loss": float(i), "rollout_uri": f"u{i}"} for i in (1, 2, 3)]
    reporting.write_metrics(cfg, rows)
    for i in (1, 2, 3):  # two optimizer steps per iteration: global steps 1-2, 3-4, 5-6
        reporting.record_train_steps(cfg, i, [{"loss": i + 0.1}, {"loss": i + 0.2}])
    with tracking.start_train(cfg, 0) as tracker:  # first attempt: commits 2, dies after row 3
        tracking.log_committed(tracker, cfg, 2)
        first_id = tracker.state["mlflow_run_id"]
    reporting.truncate_metrics(cfg, 2)  # what rl_train does on resume
    assert [r["step"] for r in reporting.read_train_steps(cfg)] == [1, 2, 3, 4]
    with tracking.start_train(cfg, 2) as tracker:
        assert tracker.state["mlflow_run_id"] == first_id
        for i in (3, 4):
            reporting.record_iteration(cfg, {"iteration": i, "rollout_id": i - 1, "train/loss": 10.0 * i})
            reporting.record_train_steps(cfg, i, [{"loss": 10 * i + 0.1}, {"loss": 10 * i + 0.2}])
        tracking.log_committed(tracker, cfg, 4)
    steps = mlflow_steps(tracking.mlflow_uri(cfg), first_id)
    assert sorted(steps) == list(range(1, 9))
    assert {s: sorted(keys) for s, keys in steps.items()} == {
        **{s: ["train_step/loss"] for s in range(5, 9)},
        **{s: ["rollout_id", "train/loss", "train_step/loss"] for s in (1, 2, 3, 4)},
    }  # each point once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking.mlflow_uri(cfg))
    assert [p.value for p in client.get_metric_history(first_id, "train/loss")] == [1.0, 2.0, 30.0, 40.0]
    # the dropped first attempt's iteration-3 steps (3.1, 3.2) are nowhere; the rerun's took their numbers
    assert [(p.step, p.value) for p in client.get_metric_history(first_id, "train_step/loss")] == [
        (1, 1.1),
        (2, 1.2),
        (3, 2.1),
        (4, 2.2),
        (5, 30.1),
        (6, 30.2),
        (7, 40.1),
        (8, 40.2),
    ]
    assert tensorboard_steps(tmp_path / "resume-unit" / "tensorboard" / "rl_train") == {
        **{i: {"rollout_id", "train/loss", "train_step/loss"} for i in (1, 2, 3, 4)},
        **{i: {"train_step/loss"} for i in (5, 6, 7, 8)},
    }
    assert problems == []


def test_a_kill_between_logging_and_the_tracking_state_logs_nothing_twice(tmp_path, monkeypatch, problems):
    """SIGKILL after MLflow took a committed iteration's points but before tracking.json said so: the resume logs
    those rows again, and MLflow must still hold each point once."""
    from mlflow.tracking import MlflowClient

    from rollflow.flows import reporting, tracking

    cfg = tracked_config(tmp_path, "kill-window", backends=["mlflow"], iterations=3)
    reporting.write_metrics(cfg, [{"iteration": i, "train/loss": float(i)} for i in (1, 2)])
    for i in (1, 2):
        reporting.record_train_steps(cfg, i, [{"loss": i + 0.1}, {"loss": i + 0.2}])
    tracker = tracking.start_train(cfg, 0)
    run_id = tracker.state["mlflow_run_id"]
    tracking.log_committed(tracker, cfg, 1)
    monkeypatch.setattr(tracker, "save_state", lambda: None)  # the kill lands here: tracking.json still says 1
    tracking.log_committed(tracker, cfg, 2)
    # nothing closes a SIGKILLed run's tracker

    with tracking.start_train(cfg, 2) as resumed:
        assert resumed.state["mlflow_run_id"] == run_id
    client = MlflowClient(tracking_uri=tracking.mlflow_uri(cfg))
    assert [(p.step, p.value) for p in client.get_metric_history(run_id, "train/loss")] == [(1, 1.0), (2, 2.0)]
    assert [p.step for p in client.get_metric_history(run_id, "train_step/loss")] == [1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert problems == []


def tensorboard_point_counts(logdir: Path) -> dict[tuple[str, int], int]:
    """(tag, step) -> how many points TensorBoard's own loader charts there (a duplicate shows as 2)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    counts: dict[tuple[str, int], int] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            counts[tag, event.step] = counts.get((tag, event.step), 0) + 1
    return counts


def test_a_kill_between_logging_and_the_tracking_state_charts_nothing_twice_in_tensorboard(
    tmp_path, monkeypatch, problems
):
    """The same kill window with TensorBoard: the resume's writer (a new event file in the same folder) skips the
    points the killed process's file holds, so TensorBoard charts each point once, with its first value."""
    from rollflow.flows import reporting, tracking

    cfg = tracked_config(tmp_path, "tb-kill", backends=["tensorboard"], iterations=3)
    reporting.write_metrics(cfg, [{"iteration": i, "train/loss": float(i)} for i in (1, 2)])
    for i in (1, 2):
        reporting.record_train_steps(cfg, i, [{"loss": i + 0.1}, {"loss": i + 0.2}])
    tracker = tracking.start_train(cfg, 0)
    tracking.log_committed(tracker, cfg, 1)
    monkeypatch.setattr(tracker, "save_state", lambda: None)  # the kill lands here: tracking.json still says 1
    tracking.log_committed(tracker, cfg, 2)
    logdir = tmp_path / "tb-kill" / "tensorboard" / "rl_train"
    before = tensorboard_point_counts(logdir)
    assert before == {
        ("train/loss", 1): 1,
        ("train/loss", 2): 1,
        **{("train_step/loss", s): 1 for s in (1, 2, 3, 4)},
    }
    monkeypatch.undo()

    with tracking.start_train(cfg, 2) as resumed:
        assert resumed.state["logged_through"] == 2
        reporting.record_iteration(cfg, {"iteration": 3, "train/loss": 3.0})
        reporting.record_train_steps(cfg, 3, [{"loss": 3.1}, {"loss": 3.2}])
        tracking.log_committed(resumed, cfg, 3)
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2  # the resume wrote a file of its own
    assert tensorboard_point_counts(logdir) == {
        **before,
        ("train/loss", 3): 1,
        ("train_step/loss", 5): 1,
        ("train_step/loss", 6): 1,
    }
    assert problems == []


def test_a_resume_from_an_older_checkpoint_charts_the_redone_steps_in_a_new_tensorboard_folder(tmp_path, problems):
    """Resuming from checkpoint 1 after step 2 was logged: the old folder keeps its points as they were; the new
    tracking run (its committed step 1, then the redone step 2) goes to a folder of its own, which TensorBoard shows
    as another run, and a later resume finds it again."""
    from rollflow.flows import reporting, tracking

    cfg = tracked_config(tmp_path, "tb-redo", backends=["tensorboard"], iterations=3)
    reporting.write_metrics(cfg, [{"iteration": i, "train/loss": float(i)} for i in (1, 2)])
    with tracking.start_train(cfg, 0) as tracker:
        tracking.log_committed(tracker, cfg, 2)
    old = tmp_path / "tb-redo" / "tensorboard" / "rl_train"
    assert tensorboard_point_counts(old) == {("train/loss", 1): 1, ("train/loss", 2): 1}

    reporting.truncate_metrics(cfg, 1)
    with tracking.start_train(cfg, 1) as tracker:
        reporting.record_iteration(cfg, {"iteration": 2, "train/loss": 20.0})
        tracking.log_committed(tracker, cfg, 2)
    assert len(problems) == 1 and "resumes from checkpoint 1" in problems[0]
    [new] = [p for p in old.iterdir() if p.is_dir()]
    assert new.name.startswith("resumed-1-")
    assert tensorboard_point_counts(old) == {("train/loss", 1): 1, ("train/loss", 2): 1}  # untouched
    assert tensorboard_point_counts(new) == {("train/loss", 1): 1, ("train/loss", 2): 1}

    with tracking.start_train(cfg, 2) as tracker:  # a plain resume of the new tracking run: same folder
        reporting.record_iteration(cfg, {"iteration": 3, "train/loss": 30.0})
        tracking.log_committed(tracker, cfg, 3)
    assert [p for p in old.iterdir() if p.is_dir()] == [new]
    assert tensorboard_point_counts(new) == {("train/loss", 1): 1, ("train/loss", 2): 1, ("train/loss", 3): 1}
    assert len(problems) == 1


def test_optimizer_loop_reports_each_step():
    """objective.minibatch_steps hands each optimizer step's statistics to `on_step`; their mean is train/*."""
    import torch

    from rollflow.tasks.train.objective import minibatch_steps

    class Rows:  # what the loop reads of a TrainBatch: size, select, response_mask
        def __init__(self, n: int):
            self.size, self.response_mask = n, torch.ones(n, 3)

        def select(self, rows: slice) -> "Rows":
            return Rows(len(range(self.size)[rows]))

    losses = iter([1.0, 2.0, 3.0, 6.0])
    norms = iter([10.0, 20.0, 30.0, 40.0])
    seen: list[dict[str, float]] = []
    out = minibatch_steps(
        Rows(8),
        4,
        64,
        zero_grad=lambda: None,
        micro_step=lambda micro, denom: {"loss": next(losses)},
        optimizer_step=lambda: next(norms),
        on_step=seen.append,
    )
    assert [(row["loss"], row["grad_norm"]) for row in seen] == [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0), (6.0, 40.0)]
    assert out["train/loss"] == 3.0 and out["train/grad_norm"] == 25.0 and out["train/step1_grad_norm"] == 10.0


# ---- end to end (Prefect + Ray) ---------------------------------------------------------------------------


@pytest.mark.slow
def test_three_iterations_to_tensorboard_mlflow_and_wandb(tmp_path, prefect_api, ray_local, offline_wandb, problems):
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking
    from rollflow.flows.reporting import read_metrics, read_train_steps
    from rollflow.flows.train import rl_train

    cfg = tracked_config(tmp_path, "tracked", iterations=3)
    summary = rl_train(cfg)
    assert summary["iterations"] == 3 and problems == []
    expected = expected_steps(cfg)
    assert "train/loss" in expected[1] and "rollout/raw_reward" in expected[1]
    # two optimizer steps per iteration, numbered across iterations; their mean is the iteration's train/*
    rows, opt = read_metrics(cfg), read_train_steps(cfg)
    assert [(r["iteration"], r["step"]) for r in opt] == [(1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6)]
    assert {"train_step/loss", "train_step/pg_loss", "train_step/grad_norm", "train_step/ppo_kl"} <= expected[6]
    for row in rows:
        mine = [r for r in opt if r["iteration"] == row["iteration"]]
        assert row["train/loss"] == pytest.approx(sum(r["train_step/loss"] for r in mine) / 2, rel=1e-6)
        assert row["train/step1_grad_norm"] == mine[0]["train_step/grad_norm"]

    assert tensorboard_steps(tmp_path / "tracked" / "tensorboard" / "rl_train") == expected

    state = json.loads((tmp_path / "tracked" / "tracking.json").read_text())
    assert state["logged_through"] == 3
    uri = tracking.mlflow_uri(cfg)
    got = mlflow_steps(uri, state["mlflow_run_id"])
    assert {step: set(keys) for step, keys in got.items()} == {
        step: {tracking.mlflow_key(k) for k in keys} for step, keys in expected.items()
    }
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
    config = {
        item.key: json.loads(item.value_json)
        for log in wandb_run.glob("run-*.wandb")
        for record in wandb_records(log)
        if record.WhichOneof("record_type") == "run"
        for item in record.run.config.update
    }  # the config logged with the run's start
    assert config["algo.advantage_estimator"] == cfg.algo.advantage_estimator
    assert not [k for k in config if "secret" in k.lower() or "token" in k.lower()]
    assert (wandb_run / "files" / "reward_curve.png").exists()


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
def test_a_failing_sink_is_disabled_with_one_warning_and_training_completes(
    tmp_path, prefect_api, ray_local, monkeypatch, problems
):
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


def mlflow_run(uri: str, experiment: str, name: str) -> list:
    """Runs of `experiment` named `name`, oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], filter_string=f"attributes.run_name = '{name}'"
    )
    return sorted(runs, key=lambda r: r.info.start_time)


def replay_expected(result: dict) -> dict[int, set[str]]:
    """What replay_train logs: each row at step = rollout id, each optimizer step at its number."""
    from rollflow.flows.tracking import numeric_metrics

    out = {
        row["rollout_id"]: set(numeric_metrics({k: v for k, v in row.items() if k != "rollout_id"}))
        for row in result["steps"]
    }
    for row in result["optimizer_steps"]:
        out.setdefault(row["step"], set()).update(k for k in row if k.startswith("train_step/"))
    return out


@pytest.mark.slow
def test_rollout_only_and_replay_train_log_to_every_sink(tmp_path, prefect_api, ray_local, offline_wandb, problems):
    from mlflow.tracking import MlflowClient

    from rollflow.flows import tracking
    from rollflow.flows.debug import replay_train, rollout_only

    cfg = tracked_config(tmp_path, "dbg-tr", iterations=2, debug={"rollout_only": True})
    out = rollout_only(cfg)
    uri = tracking.mlflow_uri(cfg)
    rollout_keys = {"rollout/raw_reward", "rollout/response_len", "rollout/truncated_ratio", "rollout/n_samples"}
    want = {0: rollout_keys, 1: rollout_keys}  # step = rollout id
    [run] = mlflow_run(uri, "rollflow-test", "dbg-tr-rollout")
    assert {s: set(k) for s, k in mlflow_steps(uri, run.info.run_id).items()} == want
    client = MlflowClient(tracking_uri=uri)
    assert [p.value for p in client.get_metric_history(run.info.run_id, "rollout/raw_reward")] == [
        out["rollouts"][0]["raw_reward"],
        out["rollouts"][1]["raw_reward"],
    ]
    assert run.data.tags["rollflow.flow"] == "rollout_only" and run.info.status == "FINISHED"
    [tb] = list((tmp_path / "dbg-tr" / "tensorboard" / "rollout_only").iterdir())  # a folder per call
    assert tensorboard_steps(tb) == want
    assert wandb_steps(tmp_path / "dbg-tr") == want

    replay_cfg = tracked_config(tmp_path, "dbg-tr2", debug={"train_only": True})
    first = replay_train(replay_cfg, rollout_ids=[0, 1], source_run="dbg-tr")
    assert [(r["rollout_id"], r["step"]) for r in first["optimizer_steps"]] == [(0, 1), (0, 2), (1, 3), (1, 4)]
    expected = replay_expected(first)
    assert {"train/loss", "rollout/raw_reward", "cached"} <= expected[0] and "train_step/grad_norm" in expected[4]
    [run] = mlflow_run(uri, "rollflow-test", "dbg-tr2-replay")
    got = mlflow_steps(uri, run.info.run_id)
    assert {s: set(k) for s, k in got.items()} == {
        s: {tracking.mlflow_key(k) for k in keys} for s, keys in expected.items()
    }
    assert all(len(keys) == len(set(keys)) for keys in got.values())
    [tb] = list((tmp_path / "dbg-tr2" / "tensorboard" / "replay_train").iterdir())
    assert tensorboard_steps(tb) == expected
    assert wandb_steps(tmp_path / "dbg-tr2") == expected

    # An identical replay is all cache hits: its tracking run still charts every optimizer step.
    second = replay_train(replay_cfg, rollout_ids=[0, 1], source_run="dbg-tr")
    assert all(s["cached"] for s in second["steps"])
    assert second["optimizer_steps"] == first["optimizer_steps"]
    again = mlflow_run(uri, "rollflow-test", "dbg-tr2-replay")[-1]
    assert [p.value for p in client.get_metric_history(again.info.run_id, "train_step/loss")] == [
        r["train_step/loss"] for r in first["optimizer_steps"]
    ]
    assert problems == []
