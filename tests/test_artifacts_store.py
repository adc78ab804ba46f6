"""The rollout artifact store: round trips, the commit protocol, checksums and error messages."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.artifacts import (
    ArtifactCorrupt,
    ArtifactExists,
    ArtifactNotFound,
    ArtifactRef,
    ArtifactSchemaError,
    EngineInfo,
    Manifest,
    RolloutStore,
    Sample,
    Status,
    producer_info,
    samples_from_parquet_bytes,
    samples_to_parquet_bytes,
)

ENGINE = EngineInfo(backend="hf", model="tiny-qwen2", weight_version=3)


def make_samples(n_prompts: int = 3, per_prompt: int = 2, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for group in range(n_prompts):
        chat = group % 2 == 1
        prompt = (
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{group}+1=? ünïcode"}]
            if chat
            else f"{group}+1="
        )
        for k in range(per_prompt):
            response_length = 3 + k
            prompt_ids = [rng.randrange(50_000) for _ in range(4)]
            log_probs = [-rng.random() * 10 for _ in range(response_length)]
            log_probs[0] = -0.0 if k == 0 else 5e-324  # sign of zero and subnormals must survive
            scalar = float(k) if k else None
            reward = {"acc": float(k), "fmt": 0.5, "nested": {"steps": [1, 2]}} if chat else scalar
            samples.append(
                Sample(
                    group_index=group,
                    index=group * per_prompt + k,
                    prompt=prompt,
                    tokens=prompt_ids + [rng.randrange(50_000) for _ in range(response_length)],
                    response=f"answer {k}",
                    response_length=response_length,
                    loss_mask=[1] * (response_length - 1) + [0],
                    rollout_log_probs=log_probs,
                    reward=reward,
                    label=str(group + 1) if group else None,
                    status=Status.TRUNCATED if k == 1 else Status.COMPLETED,
                    weight_version=3,
                    reward_key="acc" if chat else None,
                    metadata={
                        "source": "unit",
                        "deep": {"a": [1, {"b": None}]},
                        "extra_fields": {"slime_only": 7},
                    },
                )
            )
    return samples


@pytest.fixture(params=["path", "file_url", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "path":
        yield RolloutStore(str(tmp_path / "store"))
    elif request.param == "file_url":
        yield RolloutStore(f"file://{tmp_path}/store")
    elif request.param == "s3":
        # The loopback S3 endpoint, configured through the standard AWS environment variables only.
        yield RolloutStore(request.getfixturevalue("s3_endpoint").root("store"))
    else:
        # The memory filesystem is process-global: a unique root isolates tests, cleanup frees it.
        memory_store = RolloutStore(f"memory://rollflow-test-{uuid.uuid4().hex}")
        yield memory_store
        if memory_store._fs.exists(memory_store._base):
            memory_store._fs.rm(memory_store._base, recursive=True)


@pytest.fixture
def local_store(tmp_path) -> RolloutStore:
    return RolloutStore(str(tmp_path / "store"))


def write(store: RolloutStore, rollout_id: int = 0, samples=None, run: str = "run-a", split: str = "train"):
    return store.write(
        run,
        split,
        rollout_id,
        make_samples() if samples is None else samples,
        n_samples_per_prompt=2,
        engine=ENGINE,
        config_hash="cfg-123",
        extra={"note": "unit"},
    )


def samples_file(store: RolloutStore, rollout_id: int = 0) -> str:
    return f"{store._artifact_path('run-a', 'train', rollout_id)}/samples.parquet"


# ----------------------------------------------------------------------------- round trips


def test_round_trip_equal_samples_and_manifest(store):
    samples = make_samples()
    ref = write(store, 7, samples)
    assert ref == ArtifactRef(store.root, "run-a", "train", 7)
    assert ref.uri.endswith("/run-a/rollouts/train/000007")

    artifact = store.load("run-a", "train", 7)
    assert artifact.samples == samples
    assert artifact.ref == ref
    m = artifact.manifest
    assert (m.run, m.split, m.rollout_id, m.n_samples, m.n_samples_per_prompt) == ("run-a", "train", 7, 6, 2)
    assert m.engine == ENGINE and m.config_hash == "cfg-123" and m.extra == {"note": "unit"}
    assert m.producer.name == "rollflow" and m.created_at.endswith("+00:00")
    assert [f.name for f in m.files] == ["samples.parquet"]
    assert store.manifest("run-a", "train", 7) == m


def test_log_probs_round_trip_bit_exactly():
    samples = make_samples(n_prompts=4, per_prompt=4, seed=1)
    back = samples_from_parquet_bytes(samples_to_parquet_bytes(samples))
    for a, b in zip(samples, back):
        assert struct.pack(f"{len(a.rollout_log_probs)}d", *a.rollout_log_probs) == struct.pack(
            f"{len(b.rollout_log_probs)}d", *b.rollout_log_probs
        )


def test_dict_rewards_chat_prompts_and_metadata_round_trip(local_store):
    samples = make_samples()
    write(local_store, 0, samples)
    back = local_store.load("run-a", "train", 0).samples
    chat = [s for s in back if isinstance(s.prompt, list)]
    assert chat and chat[0].prompt[1]["content"].endswith("ünïcode")
    assert chat[0].reward == {"acc": 0.0, "fmt": 0.5, "nested": {"steps": [1, 2]}}
    assert chat[1].scalar_reward() == 1.0
    assert back[0].reward is None and back[1].reward == 1.0
    assert back[0].metadata["extra_fields"] == {"slime_only": 7}
    assert back[0].metadata["deep"] == {"a": [1, {"b": None}]}
    assert isinstance(back[1].status, Status) and back[1].status is Status.TRUNCATED


def test_parquet_is_plain_columnar(local_store):
    write(local_store, 0)
    table = pq.read_table(samples_file(local_store))
    types = {f.name: f.type for f in table.schema}
    # payload format 2 (format 1: int64 ids, still read); list values are required (never null) fields
    for name, value_type in (("tokens", pa.int32()), ("loss_mask", pa.int8()), ("rollout_log_probs", pa.float64())):
        assert types[name] == pa.list_(pa.field("element", value_type, nullable=False))
    assert types["reward"] == pa.float64() and types["reward_json"] == pa.string()
    for name in ("group_index", "index", "response_length", "weight_version"):
        assert types[name] == pa.int64()
    for name in ("prompt", "response", "label", "status", "reward_key", "metadata"):
        assert types[name] == pa.string()
    assert types["prompt_is_chat"] == pa.bool_()
    rows = table.to_pylist()
    assert rows[0]["status"] == "completed" and rows[1]["status"] == "truncated"
    assert json.loads(rows[2]["prompt"])[0]["role"] == "system" and rows[2]["prompt_is_chat"]
    assert json.loads(rows[0]["metadata"])["source"] == "unit"


def test_empty_rollout_round_trips(store):
    write(store, 0, [])
    assert store.load("run-a", "train", 0).samples == []


# ----------------------------------------------------------------------------- commit protocol


def test_crash_before_manifest_leaves_no_artifact_and_rewrite_succeeds(store, monkeypatch):
    # A rewrite with other bytes first waits this long for a possible concurrent writer's manifest.
    monkeypatch.setattr(RolloutStore, "LEFTOVER_GRACE_S", 0.2)
    write(store, 0)

    original_commit = RolloutStore._commit_manifest

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated crash between payload and manifest")

    monkeypatch.setattr(RolloutStore, "_commit_manifest", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        write(store, 1)
    assert store._fs.exists(samples_file(store, 1))  # the payload was written first
    assert not store.exists("run-a", "train", 1)
    assert store.list_ids("run-a", "train") == [0]
    with pytest.raises(ArtifactNotFound):
        store.load("run-a", "train", 1)

    monkeypatch.setattr(RolloutStore, "_commit_manifest", original_commit)
    samples = make_samples(seed=5)
    write(store, 1, samples)
    assert store.list_ids("run-a", "train") == [0, 1]
    assert store.load("run-a", "train", 1).samples == samples


def test_second_write_is_refused_and_keeps_the_original(store):
    original = make_samples(seed=1)
    write(store, 3, original)
    with pytest.raises(ArtifactExists) as info:
        write(store, 3, make_samples(seed=2))
    message = str(info.value)
    assert "000003" in message and "immutable" in message and "run name" in message
    assert isinstance(info.value, FileExistsError)
    assert store.load("run-a", "train", 3).samples == original


def test_concurrent_local_writers_commit_exactly_once(local_store):
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def worker(seed: int) -> None:
        barrier.wait()
        try:
            write(local_store, 0, make_samples(seed=seed))
            outcomes.append("ok")
        except ArtifactExists:
            outcomes.append("exists")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["exists"] * 5 + ["ok"]
    folder = local_store._artifact_path("run-a", "train", 0)
    assert sorted(os.listdir(folder)) == ["manifest.json", "samples.parquet"]  # no temp files left


# ----------------------------------------------------------------------------- verification


def test_flipped_byte_is_reported_as_checksum_mismatch(store):
    write(store, 0)
    path = samples_file(store)
    data = bytearray(store._fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    store._fs.pipe_file(path, bytes(data))
    with pytest.raises(ArtifactCorrupt) as info:
        store.load("run-a", "train", 0)
    message = str(info.value)
    assert "checksum" in message and "samples.parquet" in message
    assert store.artifact_uri("run-a", "train", 0) in message
    assert "regenerate" in message and "restore" in message
    assert info.value.expected_size == info.value.actual_size


def test_truncated_payload_is_corrupt(store):
    write(store, 0)
    path = samples_file(store)
    store._fs.pipe_file(path, store._fs.cat_file(path)[:100])
    with pytest.raises(ArtifactCorrupt, match="checksum") as info:
        store.load("run-a", "train", 0)
    assert info.value.actual_size == 100


def test_missing_payload_is_corrupt(local_store):
    write(local_store, 0)
    os.unlink(samples_file(local_store))
    with pytest.raises(ArtifactCorrupt, match="missing"):
        local_store.load("run-a", "train", 0)


def test_missing_id_lists_existing_ids_and_root(store):
    for rollout_id in (0, 1, 2, 5):
        write(store, rollout_id, make_samples(n_prompts=1))
    with pytest.raises(ArtifactNotFound) as info:
        store.load("run-a", "train", 4)
    message = str(info.value)
    assert "0-2, 5" in message and store.root in message and "run-a" in message
    assert info.value.existing_ids == [0, 1, 2, 5]
    with pytest.raises(ArtifactNotFound, match="no committed eval rollouts.*runs there: 'run-a'"):
        store.load("run-a", "eval", 0)


def test_unknown_schema_version_is_rejected_clearly(local_store):
    write(local_store, 0)
    path = f"{local_store._artifact_path('run-a', 'train', 0)}/manifest.json"
    raw = json.loads(open(path, "rb").read())
    raw["schema_version"] = 99
    raw["new_field"] = 1
    with open(path, "w") as fh:
        json.dump(raw, fh)
    expected = "schema_version 99 is not supported.*upgrade rollflow"
    with pytest.raises(ArtifactSchemaError, match=expected) as info:
        local_store.load("run-a", "train", 0)
    assert info.value.field == "schema_version"


def test_manifest_field_errors_name_the_field(local_store):
    write(local_store, 0)
    path = f"{local_store._artifact_path('run-a', 'train', 0)}/manifest.json"
    raw = json.loads(open(path, "rb").read())
    raw["n_samples"] = -1
    with open(path, "w") as fh:
        json.dump(raw, fh)
    with pytest.raises(ArtifactSchemaError, match="n_samples") as info:
        local_store.load("run-a", "train", 0)
    assert info.value.field == "n_samples"


def test_bad_parquet_content_names_the_column():
    with pytest.raises(ArtifactSchemaError, match="not a readable parquet"):
        samples_from_parquet_bytes(b"definitely not parquet")
    table = pq.read_table(pa.BufferReader(samples_to_parquet_bytes(make_samples())))
    sink = pa.BufferOutputStream()
    pq.write_table(table.drop_columns(["loss_mask"]), sink)
    with pytest.raises(ArtifactSchemaError, match="'loss_mask'") as info:
        samples_from_parquet_bytes(sink.getvalue().to_pybytes())
    assert info.value.field == "loss_mask"


# ----------------------------------------------------------------------------- validation


def test_invalid_sample_is_rejected_before_writing(store):
    samples = make_samples()
    samples[2].loss_mask = samples[2].loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask") as info:
        write(store, 0, samples)
    assert "samples[2]" in str(info.value)
    assert not store._fs.exists(store._artifact_path("run-a", "train", 0))


def test_non_json_metadata_names_the_field(local_store):
    samples = make_samples()
    samples[0].metadata["when"] = object()
    with pytest.raises(ArtifactSchemaError, match="metadata") as info:
        write(local_store, 0, samples)
    assert info.value.field == "metadata"


@pytest.mark.parametrize("run", ["", "a/b", "..", "a..b", ".", "has space", "star*", 7])
def test_bad_run_names_are_rejected(local_store, run):
    with pytest.raises(ValueError, match="run="):
        write(local_store, 0, run=run)


def test_bad_split_and_id_are_rejected(local_store):
    with pytest.raises(ValueError, match="split='test'"):
        write(local_store, 0, split="test")
    with pytest.raises(ValueError, match="rollout_id=-1"):
        write(local_store, -1)


# ----------------------------------------------------------------------------- refs, listing, run files


def test_refs_and_uris_round_trip(store):
    ref = write(store, 12)
    assert ArtifactRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    assert ArtifactRef.from_uri(ref.uri) == ref
    assert ArtifactRef.from_uri(ref.uri + "/manifest.json") == ref
    assert store.load_uri(ref.uri).samples == make_samples()
    # A second store instance (e.g. another process) resolves the same URI.
    assert RolloutStore(store.root).load_uri(ref.uri).manifest.rollout_id == 12
    with pytest.raises(ValueError, match="not a rollout artifact folder"):
        ArtifactRef.from_uri(store.run_uri("run-a"))


def test_relative_root_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref = write(RolloutStore("rel-root/"), 0)
    assert ref.root == str(tmp_path / "rel-root")
    assert RolloutStore("/").load_uri(ref.uri).samples == make_samples()


def test_listing(store):
    assert store.list_runs() == [] and store.list_ids("run-a", "train") == []
    write(store, 2, run="run-b")
    write(store, 0, run="run-a")
    write(store, 10, run="run-a")
    write(store, 1, run="run-a", split="eval")
    assert store.list_runs() == ["run-a", "run-b"]
    assert store.list_ids("run-a", "train") == [0, 10]
    assert store.list_ids("run-a", "eval") == [1]
    assert store.exists("run-a", "train", 10) and not store.exists("run-a", "train", 1)


def test_run_file_helpers(store):
    uri = store.write_bytes("run-a/metrics/iter_000.json", b'{"loss": 1}')
    assert uri == store.run_uri("run-a") + "/metrics/iter_000.json"
    assert store.exists_path("run-a/metrics/iter_000.json")
    assert store.read_bytes("run-a/metrics/iter_000.json") == b'{"loss": 1}'
    with store.open("run-a/notes/readme.txt", "wb") as fh:
        fh.write(b"hello")
    with store.open("run-a/notes/readme.txt") as fh:
        assert fh.read() == b"hello"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        store.read_bytes("run-a/nope.json")
    for bad in ("../escape", "/abs", "a//b", "s3://x"):
        with pytest.raises(ValueError, match="path="):
            store.read_bytes(bad)


def test_producer_info_never_raises():
    info = producer_info()
    assert info.name == "rollflow" and info.version
    assert info.git_sha is None or len(info.git_sha) >= 40


def test_manifest_rejects_unknown_fields_and_non_utc():
    base = dict(
        run="r",
        rollout_id=0,
        split="train",
        n_samples=0,
        n_samples_per_prompt=1,
        producer=producer_info(),
        engine=ENGINE,
        config_hash="h",
        files=[],
    )
    assert Manifest(**base).schema_version == 3 and Manifest(**base, schema_version=1).schema_version == 1
    with pytest.raises(ValueError, match="surprise"):
        Manifest(**base, surprise=1)
    with pytest.raises(ValueError, match="UTC"):
        Manifest(**base, created_at="2025-01-01T00:00:00+02:00")
    with pytest.raises(ValueError, match="schema_version 4"):
        Manifest(**base, schema_version=4)


# ----------------------------------------------------------------------------- S3 (moto server on loopback)


def test_s3_round_trip_commit_protocol_and_checksums(s3_endpoint, monkeypatch):
    s3_store = RolloutStore(s3_endpoint.root("prefix") + "/")
    assert not s3_store.root.endswith("/") and s3_store.root.startswith(f"s3://{s3_endpoint.bucket}/prefix-")

    ref = write(s3_store, 0)
    assert ref.uri == f"{s3_store.root}/run-a/rollouts/train/000000"
    assert s3_store.load_uri(ref.uri).samples == make_samples()
    with pytest.raises(ArtifactExists):
        write(s3_store, 0)

    monkeypatch.setattr(RolloutStore, "_commit_manifest", lambda self, *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write(s3_store, 1)
    monkeypatch.undo()
    assert s3_store.list_ids("run-a", "train") == [0] and s3_store.list_runs() == ["run-a"]

    path = samples_file(s3_store, 0)
    data = bytearray(s3_store._fs.cat_file(path))
    data[-20] ^= 0xFF
    s3_store._fs.pipe_file(path, bytes(data))
    with pytest.raises(ArtifactCorrupt, match="checksum"):
        s3_store.load("run-a", "train", 0)


def test_s3_explicit_storage_options_still_work(s3_endpoint):
    """Options passed in code (as before issue 5) are merged over the environment's."""
    s3_store = RolloutStore(
        s3_endpoint.root("explicit"), {"client_kwargs": {"endpoint_url": s3_endpoint.url}, "default_block_size": 2**20}
    )
    write(s3_store, 0)
    assert s3_store.load("run-a", "train", 0).samples == make_samples()
