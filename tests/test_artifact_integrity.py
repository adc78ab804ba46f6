"""Issue 37's artifact store: xxh3-128 digests in manifest schema 3, sha256 still verified in older artifacts
(the committed schema-2 fixture, written by rollflow dee6d82's writer), and the cheaper payload encoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.artifacts import ArtifactCorrupt, ArtifactSchemaError, RolloutStore, Sample
from rollflow.artifacts.codec import COMPRESSION, columns_to_parquet
from rollflow.artifacts.columns import SAMPLES_SCHEMA, SampleColumns
from rollflow.artifacts.digests import hexdigest
from rollflow.artifacts.manifest import FileEntry, Manifest
from rollflow.artifacts.store import MANIFEST_NAME
from tests.test_artifact_columns import ENGINE, assert_same_samples, bits, rewarded_samples

FIXTURE_V2 = Path(__file__).parent / "fixtures" / "artifacts_v2"
RUN_V2 = "fixture-v2"


def fixture_copy(tmp_path: Path) -> tuple[RolloutStore, Path]:
    root = tmp_path / "copy"
    shutil.copytree(FIXTURE_V2, root)  # never touch the committed fixture
    return RolloutStore(str(root)), root / RUN_V2 / "rollouts" / "train" / "000000"


def fixture_samples() -> list[Sample]:
    return [Sample.from_dict(d) for d in json.loads((FIXTURE_V2 / "expected_samples.json").read_text())]


def test_schema_2_fixture_still_loads_verified_by_its_sha256(tmp_path):
    store, folder = fixture_copy(tmp_path)
    artifact = store.load(RUN_V2, "train", 0)
    entry = artifact.manifest.file("samples.parquet")
    assert artifact.manifest.schema_version == 2 and entry.integrity[0] == "sha256" and entry.xxh3_128 is None
    # really the old writer's bytes: zstd on every column, nullable list values
    meta = pq.ParquetFile(folder / "samples.parquet").metadata.row_group(0)
    assert {meta.column(i).compression for i in range(meta.num_columns)} == {"ZSTD"}
    assert pq.read_schema(folder / "samples.parquet").field("tokens").type == SAMPLES_SCHEMA.field("tokens").type
    assert_same_samples(artifact.samples, fixture_samples())
    assert store.load_columns(RUN_V2, "train", 0) == SampleColumns.from_samples(fixture_samples())
    # an old artifact's content identity (the replay cache key's input) is still its bare sha256
    assert entry.content_digest == entry.sha256
    # and the manifest round-trips as its writer wrote it (no xxh3_128 key appears)
    on_disk = json.loads((folder / MANIFEST_NAME).read_text())
    assert artifact.manifest.model_dump(mode="json") == on_disk


def test_schema_2_fixture_corruption_is_named_with_sha256(tmp_path):
    store, folder = fixture_copy(tmp_path)
    payload = folder / "samples.parquet"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x10
    payload.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt) as info:
        store.load(RUN_V2, "train", 0)
    assert info.value.algorithm == "sha256"
    assert str(info.value).startswith(f"checksum mismatch for {payload}: manifest expects sha256=")


def test_new_artifacts_record_xxh3_128_only(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = rewarded_samples()
    store.write("run-i", "train", 0, samples, n_samples_per_prompt=3, engine=ENGINE, config_hash="cfg")
    folder = Path(store._artifact_path("run-i", "train", 0))
    raw = json.loads((folder / MANIFEST_NAME).read_text())
    assert raw["schema_version"] == 3
    assert set(raw["files"][0]) == {"name", "xxh3_128", "size", "format"}
    payload = (folder / "samples.parquet").read_bytes()
    assert raw["files"][0]["xxh3_128"] == hexdigest(payload, "xxh3_128")
    assert store.manifest("run-i", "train", 0).file("samples.parquet").content_digest.startswith("xxh3_128:")
    assert_same_samples(store.load("run-i", "train", 0).samples, samples)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda raw: raw.update(schema_version=2), "files"),  # a schema-3 entry read as schema 2 has no sha256
        (lambda raw: raw["files"][0].update(sha256="0" * 64), "files.0"),  # two digests
        (lambda raw: raw["files"][0].update(xxh3_128="0" * 64), "files.0.xxh3_128"),  # a sha256-long value
        (lambda raw: raw["files"][0].pop("xxh3_128"), "files.0.xxh3_128"),
    ],
)
def test_digest_fields_damaged_are_named(tmp_path, edit, field):
    store = RolloutStore(str(tmp_path / "store"))
    store.write("run-i", "train", 0, rewarded_samples(), n_samples_per_prompt=3, engine=ENGINE, config_hash="cfg")
    path = Path(store._artifact_path("run-i", "train", 0)) / MANIFEST_NAME
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(ArtifactSchemaError) as info:
        store.load("run-i", "train", 0)
    assert info.value.field.startswith(field), (info.value.field, str(info.value))


def test_file_entry_needs_exactly_one_digest():
    with pytest.raises(ValueError, match="exactly one digest"):
        FileEntry(name="samples.parquet", size=1, format="rollflow.samples/2")
    entry = FileEntry(name="samples.parquet", xxh3_128="a" * 32, size=1, format="rollflow.samples/2")
    assert entry.model_dump() == {
        "name": "samples.parquet",
        "xxh3_128": "a" * 32,
        "size": 1,
        "format": "rollflow.samples/2",
    }
    assert Manifest.model_fields["schema_version"].default == 3


def test_payload_codecs_per_column_and_required_values():
    payload = columns_to_parquet(SampleColumns.from_samples(rewarded_samples()))
    meta = pq.ParquetFile(pa.BufferReader(payload)).metadata
    chunks = [meta.row_group(0).column(i) for i in range(meta.num_columns)]
    compression = {c.path_in_schema: c.compression for c in chunks}
    # every leaf column got its configured codec (a renamed list leaf would silently fall back)
    assert set(compression) == set(COMPRESSION)
    assert compression["tokens.list.element"] == "UNCOMPRESSED"
    assert compression["rollout_log_probs.list.element"] in ("LZ4", "LZ4_RAW")
    assert compression["loss_mask.list.element"] == compression["metadata"] == "ZSTD"
    encodings = {c.path_in_schema: c.encodings for c in chunks}
    assert "BYTE_STREAM_SPLIT" in encodings["rollout_log_probs.list.element"]
    schema = pq.read_schema(pa.BufferReader(payload))
    assert not schema.field("tokens").type.value_field.nullable
    # what a reader from before issue 37 does with it (a safe cast to its own types) loses nothing
    table = pq.read_table(pa.BufferReader(payload))
    samples = rewarded_samples()
    assert table.column("tokens").cast(pa.list_(pa.int64()), safe=True).to_pylist() == [s.tokens for s in samples]
    log_probs = table.column("rollout_log_probs").cast(pa.list_(pa.float64())).to_pylist()
    assert [bits(v) for v in log_probs] == [bits(s.rollout_log_probs) for s in samples]
