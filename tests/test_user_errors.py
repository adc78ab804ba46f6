"""Flow commands: every user error is one line with exit code 2, found before Prefect, Ray or an actor
starts; the full trace goes to a log file (or the terminal with --traceback); secrets never print (issue 17)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollflow.artifacts import EngineInfo, RolloutStore, Sample


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """The `rollflow` app; starting Prefect or Ray fails the test (the checks must come first)."""
    import rollflow.flows.cli.align as align_mod
    import rollflow.flows.cli.root as cli_mod
    import rollflow.flows.group  # noqa: F401  imported before the patch, so it never binds the stub for good
    import rollflow.infra.workers as workers

    def no_prefect(*a, **k):
        raise AssertionError("Prefect was started before the input checks")

    def no_ray(*a, **k):
        raise AssertionError("Ray was started before the input checks")

    monkeypatch.setattr(cli_mod, "ensure_prefect_api", no_prefect)
    monkeypatch.setattr(align_mod, "ensure_prefect_api", no_prefect)
    monkeypatch.setattr(workers, "ensure_ray", no_ray)
    monkeypatch.setenv("ROLLFLOW_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.delenv("ROLLFLOW_TRACEBACK", raising=False)
    return cli_mod.app


def run(app, *args: str):
    return CliRunner().invoke(app, list(args))


def one_error_line(res) -> str:
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


def files(root: Path) -> dict[str, str]:
    return (
        {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }
        if root.exists()
        else {}
    )


def test_store_root_not_writable(cli, tmp_path):
    res = run(cli, "train", "--set", "store.root=/proc/self/rollflow-runs")
    line = one_error_line(res)
    assert "store.root='/proc/self/rollflow-runs' is not writable" in line
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = one_error_line(run(cli, "rollout", "--set", f"store.root={blocker}/runs"))
    assert "is a file, not a folder" in line
    assert blocker.read_text() == "x"


def test_model_dir_without_tokenizer(cli, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 10}))
    (model / "model.safetensors").write_bytes(b"")
    line = one_error_line(run(cli, "train", "--set", f"store.root={tmp_path / 'runs'}", "--set", f"model.path={model}"))
    assert "missing its tokenizer" in line
    line = one_error_line(
        run(
            cli,
            "align",
            "--local",
            "--set",
            f"store.root={tmp_path / 'runs'}",
            "--set",
            f"model.path={tmp_path / 'nope'}",
        )
    )
    assert "is not a directory" in line
    assert not (tmp_path / "runs").exists()


def test_dataset_row_without_key_found_before_start(cli, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(8)]
    rows[5] = {"question": "5+1=", "label": "6"}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        "--set",
        f"store.root={tmp_path / 'runs'}",
        "--set",
        "data.task=dataset",
        "--set",
        f"data.path={data}",
        "--set",
        "data.prompts_per_rollout=2",
        "--set",
        "rollout.n_samples_per_prompt=2",
        "--set",
        "train.num_steps_per_rollout=1",
    ]
    line = one_error_line(run(cli, "rollout", *sets))
    assert "data record 5 (line 6)" in line and "has no 'prompt' (data.input_key)" in line
    line = one_error_line(
        run(cli, "train", *sets[:-2], "--set", "train.num_steps_per_rollout=1", "--set", "data.label_key=answer")
    )
    assert "has no 'answer' (data.label_key)" in line and "data.label_key=null" in line
    # parquet: a configured key that is not a column
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["1+1="], "label": ["2"]}), tmp_path / "p.parquet")
    line = one_error_line(
        run(
            cli,
            "train",
            "--set",
            f"store.root={tmp_path / 'runs'}",
            "--set",
            "data.task=dataset",
            "--set",
            f"data.path={tmp_path / 'p.parquet'}",
            "--set",
            "data.prompts_per_rollout=1",
            "--set",
            "rollout.n_samples_per_prompt=2",
            "--set",
            "train.num_steps_per_rollout=1",
        )
    )
    assert "has no 'prompt'" in line and "['label', 'text']" in line
    assert not (tmp_path / "runs").exists()


def test_dataset_scan_streams_quickly(tmp_path):
    import time

    from rollflow.flows.preflight import scan_dataset
    from rollflow.tasks.rollout.settings import DataConfig

    path = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "What is 12345 + 67890? Answer with a number.", "label": "80235"}) + "\n"
    path.write_text(line * 200_000)
    cfg = DataConfig(task="dataset", path=str(path))
    start = time.perf_counter()
    assert scan_dataset(str(path), "auto", cfg) == 200_000
    assert time.perf_counter() - start < 5.0  # ~10M rows in well under a minute


def test_ids_and_source_run_checked_first(cli, tmp_path):
    root = tmp_path / "runs"
    store = RolloutStore(str(root))
    sample = Sample(
        group_index=0,
        index=0,
        prompt="p",
        tokens=[1, 2, 3],
        response="r",
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.1],
        reward=1.0,
    )
    store.write(
        "src",
        "train",
        0,
        [sample],
        n_samples_per_prompt=1,
        engine=EngineInfo(backend="hf", model="m", weight_version=0),
        config_hash="c",
    )
    before = files(root)
    base = [
        "--set",
        f"store.root={root}",
        "--set",
        "data.prompts_per_rollout=1",
        "--set",
        "rollout.n_samples_per_prompt=2",
        "--set",
        "train.num_steps_per_rollout=1",
    ]
    line = one_error_line(run(cli, "rollout", *base, "--ids", "3-1"))
    assert "--ids '3-1': range '3-1' runs backwards" in line and "1-3" in line
    line = one_error_line(run(cli, "replay", *base, "--source-run", "srcc"))
    assert "--source-run 'srcc' has no committed rollouts" in line and "src" in line
    line = one_error_line(run(cli, "replay", *base, "--source-run", "bad/name"))
    assert "--source-run 'bad/name'" in line
    line = one_error_line(run(cli, "replay", *base, "--source-run", "src", "--ids", "0-2"))
    assert "no rollout(s) 1-2" in line or "no rollout(s) 1, 2" in line
    assert files(root) == before


def test_full_trace_goes_to_log_file_and_traceback_flag(cli, tmp_path, monkeypatch):
    # --traceback sets ROLLFLOW_TRACEBACK in this process: monkeypatch restores it (absent) after the test, so later
    # tests in this worker (and the CLI processes they start) do not inherit it.
    monkeypatch.setenv("ROLLFLOW_TRACEBACK", "0")
    res = run(cli, "train", "--set", "store.root=/proc/self/x")
    line = one_error_line(res)
    log = Path(line.split("full trace: ", 1)[1].split(" ", 1)[0].rstrip("]"))
    assert log.parent == tmp_path / "logs" and "Traceback" in log.read_text()
    assert "PreflightError" in log.read_text()
    res = run(cli, "--traceback", "train", "--set", "store.root=/proc/self/x")
    assert res.exit_code == 2 and "Traceback" in res.output and "PreflightError" in res.output


def test_dead_engine_reported_as_dead():
    from rollflow.infra import workers

    err = workers.missing_actor_error("r1", "engine")
    assert "start the run's workers first" in str(err) and not isinstance(err, workers.WorkerDied)
    workers._STARTED.add(workers.actor_name("r1", "engine"))
    try:
        err = workers.missing_actor_error("r1", "engine")
    finally:
        workers._STARTED.discard(workers.actor_name("r1", "engine"))
    assert isinstance(err, workers.WorkerDied)
    assert "died during the run" in str(err) and "start the run's workers first" not in str(err)

    from rollflow.flows.cli.common import error_line

    class RayActorError(Exception):
        pass

    message, code = error_line(RuntimeError("wrapped").with_traceback(None))
    assert code == 1
    try:
        try:
            raise RayActorError("The actor died unexpectedly before finishing this task.")
        except RayActorError as inner:
            raise RuntimeError("sync failed") from inner
    except RuntimeError as outer:
        message, code = error_line(outer)
    assert "a worker actor died during the run" in message and code == 1


# ----------------------------------------------------------------------------- secrets


SECRET = "hunter2-very-secret-password"


def test_urls_redacted_everywhere(monkeypatch):
    from rollflow.artifacts.storage import endpoint_of, redact, redact_url

    assert redact_url(f"http://admin:{SECRET}@minio:9000/x") == "http://***@minio:9000/x"
    assert SECRET not in redact(f"endpoint https://u:{SECRET}@h and s3://b/k?X-Amz-Signature={SECRET}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:{SECRET}@127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert SECRET not in endpoint_of(None, "s3://bucket/root")

    from rollflow.tasks.rollout.remote_reward import RemoteReward
    from rollflow.tasks.rollout.settings import RolloutConfig

    reward = RemoteReward(f"https://rewards.example/score?token={SECRET}")
    assert SECRET not in reward.display_url and SECRET not in reward.__name__
    with pytest.raises(ValueError) as info:
        RolloutConfig(reward=f"https://rewards.example/score?api_key={SECRET}")
    assert SECRET not in str(info.value) and "auth_env" in str(info.value)


def test_endpoint_secret_never_printed(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://user:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    res = run(cli, "train", "--set", "store.root=s3://rollflow-nobucket/runs")
    assert res.exit_code == 2, res.output
    assert SECRET not in res.output and "s3://rollflow-nobucket" in res.output
    logs = list((tmp_path / "logs").glob("*.log"))
    assert logs and all(SECRET not in p.read_text() for p in logs)


def test_s3_checkpoint_messages_keep_the_scheme(s3_endpoint):
    from rollflow.tasks.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    root = s3_endpoint.root()
    save_checkpoint(root, "r", 1, b"one")
    save_checkpoint(root, "r", 2, b"two")
    from rollflow.artifacts.storage import open_fs

    fs, base = open_fs(root)
    fs.pipe_file(f"{base}/r/checkpoints/000002/trainer.pt", b"TWO")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root, "r", 2)
    assert f"{root}/r/checkpoints/000002/trainer.pt" in str(info.value) and root.startswith("s3://")
    assert "--resume-from 1" in str(info.value)


class _BrokenAtStart:
    """An actor whose constructor fails with a bug, not a refusal of its inputs."""

    def __init__(self):
        raise RuntimeError("cuda driver too old for this build")

    def ping(self) -> bool:
        return True


def test_an_actor_failing_in_its_constructor_is_named_with_its_error(ray_local):
    """Ray keeps only the text of what `__init__` raised: the line names the class and message, exit 1, and does not
    tell the user to rerun (a constructor that failed fails again)."""
    import ray

    from rollflow.flows.cli.common import error_line

    actor = ray.remote(_BrokenAtStart).remote()
    with pytest.raises(Exception) as raised:
        ray.get(actor.ping.remote(), timeout=60)
    message, code = error_line(raised.value)
    assert code == 1
    assert message == "a worker actor could not start (RuntimeError: cuda driver too old for this build)"
