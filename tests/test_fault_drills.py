"""Fault drills (issue 5): each ends with nothing lost and nothing half-visible, on file:// and s3://.

1. engine actor killed mid-rollout       -> the generate task's retry restarts it, the rollout completes
2. flow process SIGKILLed mid-iteration  -> the rerun resumes; no rollout id duplicated or skipped
3. S3 endpoint stopped during persist    -> retries, then one clear error; rerun completes
4. payload byte flipped / file truncated -> load fails naming the object and the checksum
5. two writers on one root               -> run namespaces separate; a second writer of an id is refused
6. code-carrying .pt                     -> refused, no code runs
7. bad endpoint / bucket / credentials   -> one clear error naming the resource and the fix

The s3:// variants run against the loopback S3 endpoint of the `s3_endpoint` fixture (moto's
server, or CI's via ROLLFLOW_TEST_S3_ENDPOINT), configured through the standard AWS variables only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from rollflow.artifacts import ArtifactCorrupt, ArtifactExists, ArtifactSchemaError, EngineInfo, RolloutStore
from rollflow.artifacts.errors import StorageAuthError, StorageBucketNotFound, StorageUnavailable
from rollflow.artifacts.storage import is_permanent, is_transient, open_fs, redact, storage_options_for
from rollflow.tasks.net import free_port
from rollflow.tasks.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from tests.conftest import TEST_AWS_SECRET, small_config
from tests.test_artifacts_store import make_samples

REPO = Path(__file__).resolve().parents[1]
ENGINE = EngineInfo(backend="hf", model="tiny", weight_version=0)


def write(store: RolloutStore, rollout_id: int, *, run: str = "run-a", seed: int = 0):
    return store.write(
        run, "train", rollout_id, make_samples(seed=seed), n_samples_per_prompt=2, engine=ENGINE, config_hash="h"
    )


def assert_nothing_half_visible(root: str, run: str) -> list[int]:
    """Every committed id loads with verified checksums; every folder with files is committed."""
    store = RolloutStore(root)
    ids = store.list_ids(run, "train")
    for rid in ids:
        store.load(run, "train", rid)  # raises on a manifest pointing at a missing or wrong payload
    fs, base = open_fs(root)
    folder = f"{base.rstrip('/')}/{run}/rollouts/train"
    fs.invalidate_cache()
    folders = {p.rstrip("/").split("/")[-2] for p in fs.find(folder)} if fs.exists(folder) else set()
    assert folders == {f"{i:06d}" for i in ids}, f"folders without a manifest: {sorted(folders)} vs ids {ids}"
    return ids


def _mutate(root: str, rel: str, change) -> None:
    fs, base = open_fs(root)
    path = f"{base.rstrip('/')}/{rel}"
    fs.pipe_file(path, change(bytes(fs.cat_file(path))))
    fs.invalidate_cache()


# ============================================================================ drill 1: engine killed


@pytest.mark.slow
def test_drill1_engine_killed_mid_rollout_task_retry_restarts_it(s3_endpoint, prefect_api, ray_local, monkeypatch):
    import rollflow.flows.group as group_module
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.drill_workers import CRASH_ROLLOUT_ID, CrashOnceRolloutWorker, drill_files

    # On S3 only: the engine's death is the same on either store, and drill 2 runs a whole resume on both.
    any_root = s3_endpoint.root()

    run = f"drill1-{uuid.uuid4().hex[:8]}"
    marker, pid_log = drill_files(run)
    # rollflow.flows.group.start_engine starts the class its module names: the engine (and its restart) is the
    # crashing subclass. Two generation batches per rollout, so the crash lands between them.
    monkeypatch.setattr(group_module, "RolloutWorker", CrashOnceRolloutWorker)
    cfg = small_config(any_root, run=run, iterations=2, rollout={"max_batch_size": 64})
    try:
        summary = rl_train(cfg)
        assert marker.exists(), "the engine was never killed: the drill did not run"
        served = [line.split() for line in pid_log.read_text().splitlines()]
    finally:
        marker.unlink(missing_ok=True)
        pid_log.unlink(missing_ok=True)

    assert summary["iterations"] == 2
    crashed = [int(pid) for split, rid, pid in served if split == "train" and int(rid) == CRASH_ROLLOUT_ID]
    # The first process died mid-rollout; the task retry started a new engine process that served it.
    assert len(crashed) == 2 and crashed[0] != crashed[1], served

    assert assert_nothing_half_visible(any_root, run) == [0, 1]
    art = RolloutStore(any_root).load(run, "train", CRASH_ROLLOUT_ID)
    assert len(art.samples) == 32 * 4 and all(s.response_length > 0 for s in art.samples)
    # The restarted engine took the trainer's live weights: version 1, as if nothing had happened.
    assert {s.weight_version for s in art.samples} == {1} and art.manifest.engine.weight_version == 1
    rows = read_metrics(cfg)
    assert [r["sync/weight_version"] for r in rows] == [1, 2]
    assert all(r["sync/parity_ok"] == 1.0 for r in rows)


# ============================================================================ drill 2: flow SIGKILLed


def _train_cmd(root: str, run: str, iterations: int) -> list[str]:
    sets = [
        f"run={run}",
        f"iterations={iterations}",
        f"store.root={root}",
        "data.prompts_per_rollout=32",
        "rollout.n_samples_per_prompt=4",
        "train.num_steps_per_rollout=1",
    ]
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train"]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def _manifests(root: str, run: str) -> dict[int, bytes]:
    fs, base = open_fs(root)
    fs.invalidate_cache()
    folder = f"{base.rstrip('/')}/{run}/rollouts/train"
    if not fs.exists(folder):
        return {}
    found = [p for p in fs.find(folder) if p.endswith("/manifest.json")]
    return {int(p.split("/")[-2]): fs.cat_file(p) for p in found}


def _exists(root: str, rel: str) -> bool:
    fs, base = open_fs(root)
    fs.invalidate_cache()
    return fs.exists(f"{base.rstrip('/')}/{rel}")


@pytest.mark.slow
def test_drill2_sigkill_mid_iteration_resumes_without_duplicates_or_gaps(s3_endpoint, prefect_api):
    """`rollflow train` is SIGKILLed (with its Ray workers) after checkpoint 2; the rerun resumes. On S3 (no shared
    disk); the same kill on a local store is tests/test_checkpoint_commit.py's, checked bit for bit."""
    any_root = s3_endpoint.root()
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    run = "killme"
    cmd = _train_cmd(any_root, run, iterations=4)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while (
        not _exists(any_root, f"{run}/checkpoints/000002/meta.json")
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.3)
    alive = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its Ray workers, mid-run
    output = proc.communicate()[0].decode(errors="replace")
    assert alive, output[-3000:]
    before = _manifests(any_root, run)
    assert {0, 1} <= set(before)

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert TEST_AWS_SECRET not in done.stdout + done.stderr + output
    after = _manifests(any_root, run)
    assert sorted(after) == [0, 1, 2, 3]  # nothing skipped or duplicated
    for rid, manifest in before.items():
        assert after[rid] == manifest, f"rollout {rid} was regenerated after resume"
    summary = json.loads(done.stdout[done.stdout.index("{") : done.stdout.index("}") + 1])
    assert summary["resumed_from"] >= 2
    fs, base = open_fs(any_root)
    metrics = [json.loads(line) for line in fs.cat_file(f"{base}/{run}/metrics.jsonl").decode().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3, 4]
    assert assert_nothing_half_visible(any_root, run) == [0, 1, 2, 3]
    assert list_checkpoints(any_root, run)[-1] == 4


# ============================================================================ drill 3: endpoint down


class StoppableEndpoint:
    """A moto S3 server on a fixed loopback port that a drill can stop and start again.

    moto keeps its buckets in process memory, so objects survive a stop/start, as on a real store.
    """

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.bucket = f"drill-{uuid.uuid4().hex[:8]}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture
def stoppable_s3(s3_endpoint, monkeypatch):
    endpoint = StoppableEndpoint()
    endpoint.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    # botocore's own retries off: the drill exercises Prefect's retries, and stays fast.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    import s3fs

    s3fs.S3FileSystem(**storage_options_for("s3://x"), skip_instance_cache=True).call_s3(
        "create_bucket", Bucket=endpoint.bucket
    )
    yield endpoint
    endpoint.stop()


class _StubEngine:
    def describe(self):
        from rollflow.infra.clients import EngineDescription

        return EngineDescription(backend="hf", model="tiny", weight_version=0)


def _persist_flow():
    from prefect import flow

    from rollflow.artifacts.store import RolloutStore
    from rollflow.flows.iteration import persist_task

    @flow(name="drill-persist")
    def drill_persist(cfg, samples, delays):
        return persist_task.with_options(retry_delay_seconds=delays)(cfg, RolloutStore(cfg.store.root), 0, samples)

    return drill_persist


def _persist_run_and_logs(flow_run_id):
    """The persist task run of a flow run, and every log line the Prefect API holds for the flow run."""
    import anyio
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            return runs, logs

    runs, logs = anyio.run(read)
    persist = [r for r in runs if r.name.startswith("persist")]
    assert len(persist) == 1, [r.name for r in runs]
    return persist[0], "\n".join(entry.message for entry in logs)


def test_drill3_persist_retries_then_fails_clearly_and_rerun_completes(stoppable_s3, prefect_api, monkeypatch):
    import rollflow.flows.iteration as iteration

    assert iteration.persist_task.retries >= 3 and iteration.persist_task.retry_delay_seconds == [1, 2, 4]
    monkeypatch.setattr(iteration.WorkerGroup, "engine", lambda group: _StubEngine())
    attempts: list[int] = []
    original_exists = RolloutStore.exists
    monkeypatch.setattr(RolloutStore, "exists", lambda self, *a: attempts.append(1) or original_exists(self, *a))
    root = f"s3://{stoppable_s3.bucket}/down"
    cfg = small_config(root, run="drill3")
    samples = make_samples(n_prompts=4, per_prompt=4)
    drill_persist = _persist_flow()

    stoppable_s3.stop()
    started = time.monotonic()
    state = drill_persist(cfg, samples, [0.2, 0.2, 0.2], return_state=True)
    assert state.is_failed()
    exc = state.result(raise_on_failure=False)
    assert isinstance(exc, StorageUnavailable) and is_transient(exc)
    assert len(attempts) == 4, "persist must be retried 3 times before failing"
    message = str(exc)
    assert stoppable_s3.url in message and repr(stoppable_s3.bucket) in message and "connectivity" in message
    assert TEST_AWS_SECRET not in message
    task_run, logged = _persist_run_and_logs(state.state_details.flow_run_id)
    assert task_run.run_count == 4 and task_run.state.is_failed()
    assert "Retry 3/3" in logged and "Retries are exhausted" in logged and TEST_AWS_SECRET not in logged
    assert time.monotonic() - started < 60

    stoppable_s3.start()
    assert RolloutStore(root).list_ids("drill3", "train") == []  # nothing committed while down
    state = drill_persist(cfg, samples, [0.2, 0.2, 0.2], return_state=True)
    assert state.is_completed(), state
    assert RolloutStore(root).load("drill3", "train", 0).samples == samples
    assert assert_nothing_half_visible(root, "drill3") == [0]


def test_drill3_endpoint_lost_between_payload_and_manifest(stoppable_s3, prefect_api, monkeypatch):
    """The endpoint dies after the payload PUT, before the manifest PUT, and comes back in time."""
    import rollflow.flows.iteration as iteration

    monkeypatch.setattr(iteration.WorkerGroup, "engine", lambda group: _StubEngine())
    original_commit = RolloutStore._commit_manifest
    commits: list[bool] = []
    seen_half: list[list[int]] = []

    def commit_while_endpoint_dies(self, path, data, *, uri):
        if not commits:
            stoppable_s3.stop()
            threading.Timer(0.3, stoppable_s3.start).start()
        commits.append(True)
        if len(commits) == 2:
            # Before the retry commits: the payload of the failed attempt is there but invisible.
            seen_half.append(RolloutStore(self.root).list_ids("drill3b", "train"))
        return original_commit(self, path, data, uri=uri)

    monkeypatch.setattr(RolloutStore, "_commit_manifest", commit_while_endpoint_dies)
    root = f"s3://{stoppable_s3.bucket}/half"
    cfg = small_config(root, run="drill3b")
    samples = make_samples(n_prompts=4, per_prompt=4, seed=3)
    state = _persist_flow()(cfg, samples, [1, 1, 1], return_state=True)
    assert state.is_completed(), state
    assert len(commits) == 2 and seen_half == [[]]
    assert RolloutStore(root).load("drill3b", "train", 0).samples == samples
    assert assert_nothing_half_visible(root, "drill3b") == [0]


def test_drill3_trainer_load_retries_but_a_train_step_never_does(prefect_api, monkeypatch):
    """A transient storage error while the trainer loads the artifact is retried; once the train step
    has run (it may have stepped the optimizer) a failure is not retried."""
    from prefect import flow

    import rollflow.flows.iteration as iteration

    calls: list[str] = []
    down = StorageUnavailable("cannot reach bucket 'b' at http://e", uri="s3://b/k", endpoint="http://e", bucket="b")

    class FlakyTrainer:
        def load_artifact(self, ref):
            calls.append("load_artifact")
            if calls.count("load_artifact") == 1:
                raise down
            return 128

        def train_on_artifact(self, ref, *, dump_uri=None, record_uri=None):
            calls.append("train_on_artifact")
            raise down  # e.g. the dump write after the optimizer step

    monkeypatch.setattr(iteration.WorkerGroup, "trainer", lambda group: FlakyTrainer())
    fast_load = iteration.load_task.with_options(retry_delay_seconds=0.1)

    @flow(name="drill-load-train")
    def load_then_train(cfg, ref):
        assert fast_load(cfg, ref) == 128
        return iteration.train_task(cfg, ref)

    from rollflow.artifacts.store import ArtifactRef

    ref = ArtifactRef("s3://b/r", "t", "train", 0)
    state = load_then_train(small_config("s3://b/r"), ref, return_state=True)
    assert state.is_failed() and isinstance(state.result(raise_on_failure=False), StorageUnavailable)
    assert calls == ["load_artifact", "load_artifact", "train_on_artifact"]
    assert iteration.train_task.retries == 0 and iteration.load_task.retries >= 3


# ============================================================================ drill 4: damaged payload


def test_drill4_flipped_byte_and_truncation_name_object_and_checksum(any_root):
    store = RolloutStore(any_root)
    for rid in (0, 1, 2):
        write(store, rid)
    expected = {rid: store.manifest("run-a", "train", rid).files[0] for rid in (0, 1)}

    def flip(data: bytes) -> bytes:
        changed = bytearray(data)
        changed[len(changed) // 2] ^= 0x01
        return bytes(changed)

    _mutate(any_root, "run-a/rollouts/train/000000/samples.parquet", flip)
    _mutate(any_root, "run-a/rollouts/train/000001/samples.parquet", lambda d: d[: len(d) // 3])
    _mutate(any_root, "run-a/rollouts/train/000002/manifest.json", lambda d: d[: len(d) // 2])

    for rid, damage in ((0, "flipped"), (1, "truncated")):
        with pytest.raises(ArtifactCorrupt) as info:
            store.load("run-a", "train", rid)
        message = str(info.value)
        assert f"{any_root}/run-a/rollouts/train/{rid:06d}/samples.parquet" in message, damage
        assert "checksum" in message and expected[rid].xxh3_128 in message
        assert info.value.actual_digest != expected[rid].xxh3_128
    assert info.value.actual_size == expected[1].size // 3
    with pytest.raises(ArtifactSchemaError, match="not valid JSON") as bad_manifest:
        store.load("run-a", "train", 2)
    assert "000002/manifest.json" in str(bad_manifest.value)
    # A damaged artifact is never "retried away": the retry conditions treat it as permanent.
    assert is_permanent(info.value) and not is_transient(info.value)

    save_checkpoint(any_root, "run-a", 1, os.urandom(4096))
    _mutate(any_root, "run-a/checkpoints/000001/trainer.pt", flip)
    with pytest.raises(CheckpointError, match=r"trainer\.pt fails its checksum"):
        load_checkpoint(any_root, "run-a", 1)


# ============================================================================ drill 5: concurrent writers


def test_drill5_two_runs_at_once_keep_separate_namespaces(any_root):
    errors: list[BaseException] = []

    def run_writer(run: str, seed: int) -> None:
        try:
            store = RolloutStore(any_root)
            for rid in range(4):
                write(store, rid, run=run, seed=seed + rid)
                save_checkpoint(any_root, run, rid + 1, f"{run}-{rid}".encode())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run_writer, args=(run, seed)) for run, seed in (("run-a", 0), ("run-b", 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store = RolloutStore(any_root)
    assert store.list_runs() == ["run-a", "run-b"]
    for run, seed in (("run-a", 0), ("run-b", 100)):
        assert assert_nothing_half_visible(any_root, run) == [0, 1, 2, 3]
        for rid in range(4):
            assert store.load(run, "train", rid).samples == make_samples(seed=seed + rid)
        assert list_checkpoints(any_root, run) == [1, 2, 3, 4]
        assert load_checkpoint(any_root, run, 4) == f"{run}-3".encode()


def test_drill5_racing_writers_of_one_id_exactly_one_commits(any_root):
    outcomes: dict[int, str] = {}
    barrier = threading.Barrier(6)

    def writer(seed: int) -> None:
        store = RolloutStore(any_root)
        barrier.wait()
        try:
            write(store, 0, seed=seed)
            outcomes[seed] = "ok"
        except ArtifactExists as exc:
            outcomes[seed] = "refused: " + str(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [seed for seed, outcome in outcomes.items() if outcome == "ok"]
    assert len(outcomes) == 6 and len(winners) == 1, outcomes
    # Nothing lost: the committed artifact is exactly the winner's data, checksums intact.
    assert RolloutStore(any_root).load("run-a", "train", 0).samples == make_samples(seed=winners[0])
    assert assert_nothing_half_visible(any_root, "run-a") == [0]


def test_drill5_writer_with_a_stale_check_is_refused_by_the_store(any_root, monkeypatch):
    """The second writer checked "id free" before the first committed: the store itself refuses it."""
    first = RolloutStore(any_root)
    write(first, 0, seed=1)
    late = RolloutStore(any_root)
    monkeypatch.setattr(late, "_exists", lambda path: False)  # every existence check is stale
    with pytest.raises(ArtifactExists):
        write(late, 0, seed=2)
    # The commit point alone (exclusive create / If-None-Match PUT) refuses a second manifest too.
    folder = late._artifact_path("run-a", "train", 0)
    with pytest.raises(ArtifactExists):
        late._commit_manifest(f"{folder}/manifest.json", b"{}", uri=late.artifact_uri("run-a", "train", 0))
    monkeypatch.undo()
    assert first.load("run-a", "train", 0).samples == make_samples(seed=1)


def test_drill5_payload_replaced_before_the_commit_is_repaired_by_the_winner(any_root, monkeypatch):
    """A stalled loser replaced the payload between the winner's payload and manifest writes."""
    store = RolloutStore(any_root)
    original_commit = RolloutStore._commit_manifest

    def loser_lands_first(self, path, data, *, uri):
        payload = path.rsplit("/", 1)[0] + "/samples.parquet"
        self._fs.pipe_file(payload, b"a loser's payload")
        return original_commit(self, path, data, uri=uri)

    monkeypatch.setattr(RolloutStore, "_commit_manifest", loser_lands_first)
    write(store, 0, seed=4)
    monkeypatch.undo()
    assert store.load("run-a", "train", 0).samples == make_samples(seed=4)


def test_drill5_loser_landing_after_the_commit_is_detected_not_read(any_root, monkeypatch):
    """The residual window (a writer stalled past LEFTOVER_GRACE_S, landing after the winner's
    check): the loser is refused and told, and the damage is caught by the checksum on load."""
    write(RolloutStore(any_root), 0, seed=1)
    late = RolloutStore(any_root)
    monkeypatch.setattr(RolloutStore, "LEFTOVER_GRACE_S", 0.0)
    monkeypatch.setattr(late, "_exists", lambda path: path.endswith("samples.parquet"))  # stale: "no manifest"
    with pytest.raises(ArtifactExists, match="loading the artifact will fail its checksum"):
        write(late, 0, seed=2)
    monkeypatch.undo()
    with pytest.raises(ArtifactCorrupt, match="checksum"):
        RolloutStore(any_root).load("run-a", "train", 0)


def test_drill5_endpoint_without_conditional_puts_falls_back_and_warns(s3_endpoint, monkeypatch, caplog):
    import botocore.exceptions

    monkeypatch.setattr(RolloutStore, "_no_conditional_put", set())
    store = RolloutStore(s3_endpoint.root("nocond"))
    original = store._fs.call_s3

    def no_if_none_match(method, *args, **kwargs):
        if "IfNoneMatch" in kwargs:
            raise botocore.exceptions.ClientError(
                {
                    "Error": {
                        "Code": "NotImplemented",
                        "Message": "A header you provided implies functionality that is not implemented",
                    },
                    "ResponseMetadata": {"HTTPStatusCode": 501},
                },
                "PutObject",
            )
        return original(method, *args, **kwargs)

    monkeypatch.setattr(store._fs, "call_s3", no_if_none_match)
    with caplog.at_level(logging.WARNING, logger="rollflow.artifacts.store"):
        write(store, 0)
        write(store, 1)
    warnings = [r for r in caplog.records if "conditional writes" in r.getMessage()]
    assert len(warnings) == 1 and s3_endpoint.url in warnings[0].getMessage()
    with pytest.raises(ArtifactExists):  # the existence check still refuses a sequential second writer
        write(store, 0, seed=9)
    assert store.load("run-a", "train", 0).samples == make_samples()


# ============================================================================ drill 6: code in a .pt


class _RunsCode:
    """Unpickling this creates `marker`: proof that code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


@pytest.mark.parametrize("fmt", ["torch-zip", "raw-pickle"])
def test_drill6_code_carrying_pt_is_refused_and_runs_nothing(any_root, tmp_path, fmt):
    import io

    import torch

    from rollflow.artifacts.slime import import_slime_pt

    def crafted(marker: Path) -> bytes:
        payload = {"rollout_id": 0, "samples": [_RunsCode(str(marker))]}
        if fmt == "raw-pickle":
            return pickle.dumps(payload, protocol=2)
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf.getvalue()

    # The crafted file is live: a plain unpickle does run its code.
    live = tmp_path / "live-marker"
    if fmt == "raw-pickle":
        pickle.loads(crafted(live))
    else:
        torch.load(io.BytesIO(crafted(live)), weights_only=False)
    assert live.exists()

    marker = tmp_path / "marker"
    fs, base = open_fs(any_root)
    target = f"{base.rstrip('/')}/dumps/data_0.pt"
    fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(target, crafted(marker))
    with pytest.raises(ArtifactSchemaError, match="refusing to load this .pt") as info:
        import_slime_pt(f"{any_root}/dumps/data_0.pt")
    assert "weights_only" in str(info.value) and "data_0.pt" in str(info.value)
    assert not marker.exists(), "code from the .pt ran"


# ============================================================================ drill 7: bad inputs


def test_drill7_config_errors_name_field_and_fix():
    """The config half (more in test_config.py): one error each, naming the field and the fix."""
    from rollflow.flows.config_loading import ConfigError, load_config

    cases = {
        "trian.lr=1e-4": ("trian", "unknown field"),
        "data.prompts_per_rollout=-4": ("data.prompts_per_rollout", "greater than or equal to 1"),
        "debug.save_debug_rollout_data=/d/data.pt": ("debug.save_debug_rollout_data", "{rollout_id}"),
        f"store.root=s3://AKIAEXAMPLE:{TEST_AWS_SECRET}@bucket/x": ("store.root", "AWS_ACCESS_KEY_ID"),
        f"store.root=s3://bucket/x?secret={TEST_AWS_SECRET}": ("store.root", "AWS_PROFILE"),
    }
    for override, (field, fix) in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        message = str(info.value)
        assert field in message and fix in message, message
        assert TEST_AWS_SECRET not in message


def test_drill7_unreachable_endpoint_is_named(s3_endpoint, monkeypatch):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = RolloutStore(f"s3://{s3_endpoint.bucket}/unreachable")
    for attempt in (store.check_access, lambda: write(store, 0), lambda: store.load("run-a", "train", 0)):
        with pytest.raises(StorageUnavailable) as info:
            attempt()
        message = str(info.value)
        assert dead in message and repr(s3_endpoint.bucket) in message and "check connectivity" in message
        assert TEST_AWS_SECRET not in message and is_transient(info.value)


def test_drill7_missing_bucket_is_named_with_the_fix(s3_endpoint):
    store = RolloutStore("s3://rollflow-no-such-bucket/x")
    for attempt in (store.check_access, lambda: write(store, 0), lambda: store.load("run-a", "train", 0)):
        with pytest.raises(StorageBucketNotFound) as info:
            attempt()
        message = str(info.value)
        assert "'rollflow-no-such-bucket' does not exist" in message and s3_endpoint.url in message
        assert "aws s3 mb s3://rollflow-no-such-bucket" in message and is_permanent(info.value)


def _moto_auth(endpoint: str, count: str) -> None:
    """moto's switch: after `count` more requests, every request needs credentials moto's IAM knows."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=10).read()


def test_drill7_bad_credentials_are_named_without_leaking_them(s3_endpoint, monkeypatch):
    good = RolloutStore(s3_endpoint.root("auth"))
    write(good, 0)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_AWS_SECRET + "-wrong")
    _moto_auth(s3_endpoint.url, "0")  # enforce: our dummy keys are not in moto's IAM, so all are refused
    try:
        store = RolloutStore(good.root, {"skip_instance_cache": True})
        for attempt in (store.check_access, lambda: write(store, 1), lambda: store.load("run-a", "train", 0)):
            with pytest.raises(StorageAuthError) as info:
                attempt()
            message = str(info.value)
            assert repr(s3_endpoint.bucket) in message and "AWS_ACCESS_KEY_ID" in message
            assert TEST_AWS_SECRET not in message and is_permanent(info.value)
    finally:
        _moto_auth(s3_endpoint.url, "inf")
    assert good.list_ids("run-a", "train") == [0]  # nothing half-written by the refused writer


def test_drill7_preflight_fails_rl_train_before_any_actor(s3_endpoint, prefect_api, ray_local):
    from rollflow.flows.group import get_actor
    from rollflow.flows.train import rl_train

    cfg = small_config("s3://rollflow-no-such-bucket/x", run="drill7-preflight")
    with pytest.raises(StorageBucketNotFound, match="rollflow-no-such-bucket"):
        rl_train(cfg)
    assert get_actor("drill7-preflight", "engine") is None and get_actor("drill7-preflight", "trainer") is None


# ============================================================================ helpers and conditions


def test_secrets_are_redacted_and_retry_conditions_classify(monkeypatch):
    from prefect.states import Failed

    from rollflow.flows.prefect_ops.retrying import retry_if_transient, retry_unless_permanent

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_AWS_SECRET)
    assert redact(f"sig for {TEST_AWS_SECRET} failed") == "sig for *** failed"
    assert redact("token=abcdefgh12345678", {"token": "abcdefgh12345678"}) == "token=***"

    down = StorageUnavailable("cannot reach", uri="s3://b/k", endpoint="http://e", bucket="b")
    wrapped = RuntimeError("actor failed")
    wrapped.cause = down  # how Ray's RayTaskError carries the actor's exception
    corrupt = ArtifactCorrupt(
        "s3://b/k",
        expected_digest="0" * 32,
        actual_digest="1" * 32,
        expected_size=1,
        actual_size=1,
        algorithm="xxh3_128",
    )
    cases = [
        (down, True, True),
        (wrapped, True, True),
        (ConnectionResetError(), True, True),
        (corrupt, False, False),
        (ArtifactExists("s3://b/k"), False, False),
        (StorageAuthError("denied"), False, False),
        (ValueError("bug"), False, True),
    ]
    for exc, transient, unless_permanent in cases:
        state = Failed(data=exc)
        assert retry_if_transient(None, None, state) is transient, exc
        assert retry_unless_permanent(None, None, state) is unless_permanent, exc
    # Errors cross Ray and Prefect process boundaries pickled: fields and messages survive.
    for exc in (down, corrupt, ArtifactExists("s3://b/k", note="n")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)


def test_storage_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    options = storage_options_for("s3://bucket/x")
    assert options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert "region_name" not in options["client_kwargs"]  # breaks mkdir on non-AWS endpoints
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")
    assert storage_options_for("s3://bucket/x")["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:10"
    explicit = storage_options_for("s3://b", {"client_kwargs": {"endpoint_url": "http://x"}, "anon": True})
    assert explicit == {"client_kwargs": {"endpoint_url": "http://x"}, "anon": True}
    assert storage_options_for("file:///tmp/x") == {} and storage_options_for("/tmp/x") == {}
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert storage_options_for("s3://bucket/x") == {}
    # No credentials in a config, hence in Prefect parameters.
    cfg = small_config("s3://bucket/x")
    assert TEST_AWS_SECRET not in cfg.model_dump_json()
    assert hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()  # JSON-able as a flow parameter
