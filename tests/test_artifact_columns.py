"""Columnar artifacts: round trips through Arrow columns, the format-1 fixture, the trainer's batch from
columns, and the errors a damaged payload gives."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollflow.artifacts import ArtifactCorrupt, ArtifactSchemaError, EngineInfo, RolloutStore, Sample, Status
from rollflow.artifacts.codec import PAYLOAD_FORMAT, columns_from_parquet, columns_to_parquet
from rollflow.artifacts.columns import ListColumn, SampleColumns
from rollflow.tasks.train import batch_columns
from rollflow.tasks.train.batch import batch_from_samples
from rollflow.tasks.train.batch_columns import batch_from_columns
from tests.test_artifacts_store import make_samples

FIXTURE = Path(__file__).parent / "fixtures" / "artifacts_v1"
ENGINE = EngineInfo(backend="hf", model="tiny-qwen2", weight_version=3)


def bits(values: list[float]) -> bytes:
    return struct.pack(f"{len(values)}d", *values)


def assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    assert got == want
    for a, b in zip(got, want):  # == treats -0.0 == 0.0: compare the log-probs' bits too
        assert bits(a.rollout_log_probs) == bits(b.rollout_log_probs)
        assert type(a.status) is Status and all(type(t) is int for t in a.tokens)


def rewarded_samples(n_prompts: int = 4, per_prompt: int = 3, seed: int = 0) -> list[Sample]:
    """make_samples' variety (chat prompts, dict rewards, -0.0 / subnormal log-probs), every reward set."""
    samples = make_samples(n_prompts, per_prompt, seed)
    for s in samples:
        if s.reward is None:
            s.reward = -0.0
    samples[0].tokens = samples[0].tokens[:2] + samples[0].tokens  # uneven lengths: padding matters
    return samples


def write(store: RolloutStore, samples, rollout_id: int = 0):
    return store.write("run-c", "train", rollout_id, samples, n_samples_per_prompt=3, engine=ENGINE, config_hash="cfg")


# ----------------------------------------------------------------------------- round trips


def test_columns_round_trip_every_field(tmp_path):
    samples = make_samples(n_prompts=4, per_prompt=3, seed=2)
    samples[1].metadata["nan_metric"] = float("nan")
    samples[2].reward = float("nan")
    samples[3].rollout_log_probs[-1] = -1e-310  # subnormal
    columns = SampleColumns.from_samples(samples)
    back = columns_from_parquet(columns_to_parquet(columns)).to_samples()
    assert math.isnan(back[1].metadata.pop("nan_metric")) and math.isnan(back[2].reward)
    samples[1].metadata.pop("nan_metric")
    back[2].reward = samples[2].reward = 0.5
    assert_same_samples(back, samples)


def test_store_holds_columns_and_builds_samples_only_when_asked(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = make_samples()
    write(store, samples)
    artifact = store.load("run-c", "train", 0)
    assert artifact._samples is None  # nothing per row or per token yet
    assert len(artifact) == len(samples) and len(artifact.columns) == len(samples)
    assert artifact.columns.list_column("tokens").values.dtype == np.int32
    assert_same_samples(artifact.samples, samples)
    assert artifact.samples is artifact.samples  # built once, then kept (callers may edit them)
    assert store.load_columns("run-c", "train", 0) == artifact.columns
    manifest = artifact.manifest
    assert manifest.schema_version == 3 and manifest.file("samples.parquet").format == PAYLOAD_FORMAT
    assert manifest.file("samples.parquet").integrity[0] == "xxh3_128"


def test_write_columns_directly_equals_write_samples(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = make_samples()
    write(store, samples, 0)
    write(store, SampleColumns.from_samples(samples), 1)
    files = [store.manifest("run-c", "train", i).file("samples.parquet") for i in (0, 1)]
    assert files[0].xxh3_128 == files[1].xxh3_128
    assert_same_samples(store.load("run-c", "train", 1).samples, samples)


def test_from_arrays_matches_from_samples():
    samples = [
        Sample(
            group_index=i // 2,
            index=i,
            prompt="p",
            tokens=[5, 6, 7 + i, 8][: 3 + i % 2],
            response="",
            response_length=1 + i % 2,
            loss_mask=[1] * (1 + i % 2),
            rollout_log_probs=[-0.5] * (1 + i % 2),
            reward=float(i),
            status=Status.COMPLETED,
        )
        for i in range(4)
    ]
    lengths = np.array([len(s.tokens) for s in samples])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    columns = SampleColumns.from_arrays(
        group_index=np.array([s.group_index for s in samples]),
        index=np.arange(4),
        tokens=ListColumn(offsets, np.concatenate([s.tokens for s in samples])),
        response_length=np.array([s.response_length for s in samples]),
        loss_mask=np.concatenate([s.loss_mask for s in samples]).astype(np.int8),
        rollout_log_probs=np.concatenate([s.rollout_log_probs for s in samples]),
        reward=np.arange(4, dtype=np.float64),
        prompt="p",
    )
    assert columns == SampleColumns.from_samples(samples)


def test_contract_errors_name_the_row(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = make_samples()
    samples[4].rollout_log_probs[1] = float("nan")
    with pytest.raises(ArtifactSchemaError, match=r"samples\[4\].*rollout_log_probs contains NaN"):
        write(store, samples)
    samples = make_samples()
    samples[3].response_length += 1
    with pytest.raises(ArtifactSchemaError, match=r"samples\[3\]: Sample \(group 1, index 3\): len\(loss_mask\)"):
        write(store, SampleColumns.from_samples(samples))
    samples = make_samples()
    samples[0].tokens = ["x"] + samples[0].tokens[1:]
    with pytest.raises(ArtifactSchemaError, match="tokens"):
        write(store, samples)
    assert not store.exists("run-c", "train", 0)


# ----------------------------------------------------------------------------- the format-1 fixture


def expected_fixture_samples() -> list[Sample]:
    return [Sample.from_dict(d) for d in json.loads((FIXTURE / "expected_samples.json").read_text())]


def test_format_1_fixture_still_loads(tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(FIXTURE, root)  # never touch the committed fixture
    store = RolloutStore(str(root))
    artifact = store.load("fixture-v1", "train", 0)
    assert artifact.manifest.schema_version == 1
    assert artifact.manifest.file("samples.parquet").format is None
    assert artifact.manifest.file_format("samples.parquet") == "rollflow.samples/1"
    assert (
        pq.read_schema(root / "fixture-v1/rollouts/train/000000/samples.parquet").field("tokens").type.value_type
        == pa.int64()
    )  # really the old format
    assert_same_samples(artifact.samples, expected_fixture_samples())
    assert artifact.columns.list_column("tokens").values.dtype == np.int32  # read into the current columns
    # ... and the batch built from its columns is the batch built from its Samples
    expected = expected_fixture_samples()
    rows = [i for i, s in enumerate(expected) if s.reward is not None and s.prompt_length > 0][:4]
    assert len(rows) == 4
    assert_same_batch(
        batch_from_columns(artifact.columns.take(rows), group_size=2),
        batch_from_samples([expected[i] for i in rows], group_size=2),
    )


def test_unknown_payload_format_is_refused_clearly(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    write(store, make_samples())
    path = Path(store._artifact_path("run-c", "train", 0)) / "manifest.json"
    raw = json.loads(path.read_text())
    raw["files"][0]["format"] = "rollflow.samples/99"
    path.write_text(json.dumps(raw))
    with pytest.raises(ArtifactSchemaError, match="payload format 'rollflow.samples/99'.*upgrade rollflow"):
        store.load("run-c", "train", 0)


def test_format_2_payload_reads_as_format_1_types(tmp_path):
    """What an older reader does with the new payload: its safe cast back to int64 ids loses nothing."""
    samples = make_samples()
    table = pq.read_table(pa.BufferReader(columns_to_parquet(SampleColumns.from_samples(samples))))
    tokens = table.column("tokens").cast(pa.list_(pa.int64()), safe=True).to_pylist()
    assert tokens == [s.tokens for s in samples]


# ----------------------------------------------------------------------------- damaged payloads


def test_corrupted_payload_gives_the_one_line_checksum_error(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    write(store, make_samples())
    path = Path(store._artifact_path("run-c", "train", 0)) / "samples.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))
    for load in (store.load, store.load_columns, store.load_table):
        with pytest.raises(ArtifactCorrupt) as info:
            load("run-c", "train", 0)
        message = str(info.value)
        assert "\n" not in message
        uri = f"{store.artifact_uri('run-c', 'train', 0)}/samples.parquet"
        assert message.startswith(f"checksum mismatch for {uri}: manifest expects xxh3_128=")
        assert info.value.actual_size == info.value.expected_size == len(data)


# ----------------------------------------------------------------------------- the trainer's batch


def assert_same_batch(got, want) -> None:
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, field.name
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def test_batch_from_columns_equals_batch_from_samples(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = rewarded_samples()
    samples[5].response_length = 0
    samples[5].loss_mask, samples[5].rollout_log_probs = [], []
    samples[7].loss_mask = [0, 1, 0, 1][: samples[7].response_length]
    write(store, samples)
    artifact = store.load("run-c", "train", 0)
    assert_same_batch(
        batch_from_columns(artifact.columns, group_size=3), batch_from_samples(artifact.samples, group_size=3)
    )
    # the run's reward key wins for dict rewards, as train_on_artifact does on Samples
    for s in samples:
        if isinstance(s.reward, dict):
            s.reward_key = "fmt"
    assert_same_batch(
        batch_from_columns(artifact.columns, group_size=3, reward_key="fmt"), batch_from_samples(samples, group_size=3)
    )


def test_batch_span_mask_and_ids_follow_each_sample(tmp_path, monkeypatch):
    """The compact batch (int32 ids, bool loss mask, span from per-row lengths) against each sample's own
    prompt / response split, with blocks of a few rows so one chunk is filled in several blocks."""
    monkeypatch.setattr(batch_columns, "BLOCK_TOKENS", 8)
    store = RolloutStore(str(tmp_path / "store"))
    samples = rewarded_samples()
    samples[4].loss_mask = [1, 0] * (samples[4].response_length // 2) + [1] * (samples[4].response_length % 2)
    write(store, samples)
    batch = batch_from_columns(store.load("run-c", "train", 0).columns, group_size=3)
    assert batch.tokens.dtype == torch.int32 and batch.response_mask.dtype == torch.bool
    span = batch.span()
    for row, s in enumerate(samples):
        first = len(s.tokens) - s.response_length - 1  # the column scoring the first response token
        want_span = [first <= j < first + s.response_length for j in range(batch.tokens.shape[1] - 1)]
        assert span[row].tolist() == want_span
        assert batch.response_mask[row][span[row]].tolist() == [bool(m) for m in s.loss_mask]
        assert not batch.response_mask[row][~span[row]].any()
        assert batch.tokens[row, : len(s.tokens)].tolist() == s.tokens
        assert not batch.tokens[row, len(s.tokens) :].any()


def test_batch_from_columns_errors_as_batch_from_samples():
    samples = rewarded_samples()
    columns = SampleColumns.from_samples(samples)
    with pytest.raises(ValueError, match="multiple of n_samples_per_prompt=5"):
        batch_from_columns(columns, group_size=5)
    samples[2].reward = None
    with pytest.raises(ValueError, match=r"Sample \(group 0, index 2\) has no reward yet"):
        batch_from_columns(SampleColumns.from_samples(samples), group_size=3)
    with pytest.raises(ValueError, match="empty rollout"):
        batch_from_columns(SampleColumns.from_samples([]), group_size=1)


def test_row_groups_load_as_chunks_without_combining(tmp_path, monkeypatch):
    """A payload of many row groups loads as a chunked table; every consumer walks the chunks."""
    from rollflow.artifacts import codec

    monkeypatch.setattr(codec, "ROW_GROUP_BYTES", 600)  # a few rows per group
    store = RolloutStore(str(tmp_path / "store"))
    samples = rewarded_samples(n_prompts=5, per_prompt=3)
    write(store, samples)
    path = Path(store._artifact_path("run-c", "train", 0)) / "samples.parquet"
    assert pq.ParquetFile(path).metadata.num_row_groups > 2
    columns = store.load_columns("run-c", "train", 0)
    assert len(columns.chunks()) > 2 and columns.table.column("tokens").num_chunks > 2
    assert_same_samples(columns.to_samples(), samples)
    assert_same_samples(columns.to_samples([13, 1]), [samples[13], samples[1]])
    assert_same_batch(batch_from_columns(columns, group_size=3), batch_from_samples(samples, group_size=3))
    samples[13].rollout_log_probs[0] = float("nan")
    bad = columns_from_parquet(columns_to_parquet(SampleColumns.from_samples(samples)))
    assert bad.first_invalid()[0] == 13 and "NaN" in bad.first_invalid()[1]


def test_train_step_on_columns_equals_train_step_on_samples(tmp_path):
    """The trainer's whole step (scoring, advantages, metrics, optimizer) on an artifact's columns is the
    step on its Samples: same metrics, same batch tensors, same weights after."""
    from rollflow.tasks.model.source import resolve_model_path
    from rollflow.tasks.model.tiny import load_model
    from rollflow.tasks.train.replay import infer_group_size, subsample_groups
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
    from rollflow.tasks.train.step import train_on_samples
    from rollflow.tasks.train.torch_backend import TorchBackend

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):  # "012+345=" style prompts of the built-in char vocabulary, ragged responses
        prompt = torch.randint(3, 14, (8,), generator=gen).tolist()
        length = 2 + i % 3
        samples.append(
            Sample(
                group_index=i // 4,
                index=i,
                prompt="p",
                tokens=prompt + torch.randint(3, 14, (length,), generator=gen).tolist(),
                response="r",
                response_length=length,
                loss_mask=[1] * length,
                rollout_log_probs=(-torch.rand(length, generator=gen)).tolist(),
                reward={"acc": float(i % 2), "fmt": 1.0},
                reward_key="fmt",
                status=Status.TRUNCATED if i % 5 == 0 else Status.COMPLETED,
            )
        )
    store = RolloutStore(str(tmp_path / "store"))
    store.write("run-t", "train", 0, samples, n_samples_per_prompt=4, engine=ENGINE, config_hash="cfg")
    columns = store.load_columns("run-t", "train", 0).with_reward_key("acc")
    for s in samples:
        s.reward_key = "acc"
    assert infer_group_size(columns) == infer_group_size(samples) == 4
    assert subsample_groups(columns, 0.5, 4).to_samples() == subsample_groups(samples, 0.5, 4)
    assert not columns.metadata_flag("rollout_log_probs_missing")

    results = []
    for rows in (samples, columns):
        torch.manual_seed(0)
        backend = TorchBackend(
            load_model(resolve_model_path("builtin:addition")), OptimConfig(num_steps_per_rollout=2, micro_batch_size=8)
        )
        result = train_on_samples(backend, rows, AlgoConfig(), group_size=4)
        results.append((result, {k: v.clone() for k, v in backend.named_weights().items()}))
    (a, wa), (b, wb) = results
    assert a.metrics == b.metrics and a.metrics["rollout/raw_reward"] == 0.5
    assert_same_batch(b.batch, a.batch)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_column_checks_match_the_sample_checks():
    from rollflow.artifacts.slime import TokenOutOfVocab, check_token_ids

    samples = make_samples(n_prompts=4, per_prompt=3)
    samples[7].metadata["rollout_log_probs_missing"] = True
    samples[2].metadata["note"] = "mentions rollout_log_probs_missing in text only"
    columns = columns_from_parquet(columns_to_parquet(SampleColumns.from_samples(samples)))
    assert columns.metadata_flag("rollout_log_probs_missing")
    assert not columns.take([0, 1, 2]).metadata_flag("rollout_log_probs_missing")
    samples[9].tokens[-1] = 60_000
    columns = SampleColumns.from_samples(samples)
    with pytest.raises(TokenOutOfVocab) as want:
        check_token_ids(samples, 50_000, rollout_id=3)
    with pytest.raises(TokenOutOfVocab) as got:
        check_token_ids(columns, 50_000, rollout_id=3)
    assert str(got.value) == str(want.value) and "sample 9 " in str(got.value)
    check_token_ids(columns, 70_000, rollout_id=3)  # in range: no error
