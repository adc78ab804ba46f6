"""A committed artifact, damaged every way we can think of: each load raises one of the store's named errors
(`ArtifactError` and its subclasses) or returns exactly the original data; never a raw TypeError / KeyError,
never different data (issue 36).

The mutations are built from the JSON read back from disk, not from the manifest model: every field (nested
ones and list items included) set to null, a string, -1, a huge int, a list, a dict, or dropped; bit flips and
truncations of every file; each file deleted.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from rollflow.artifacts import ArtifactError, RolloutStore
from rollflow.artifacts.store import MANIFEST_NAME
from tests.test_artifacts_store import ENGINE, make_samples

RUN, SPLIT, ROLLOUT_ID = "mut", "train", 7
DROP = object()
VALUES: list[Any] = [None, "mutated", -1, 2**64, 10**30, [], [1, "x"], {}, {"mutated": 1}, DROP]
# What a reader acts on besides the samples; the rest (run, created_at, producer, engine names, config_hash,
# extra) is provenance, which may hold any value of its type (the manifest carries no checksum of itself).
DATA_FIELDS = ("schema_version", "split", "rollout_id", "n_samples", "n_samples_per_prompt")


def walk(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every position in a JSON document, parents before children."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield (*path, key)
        yield from walk(value, (*path, key))


def mutated(doc: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if value is DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)
    return out


def file_mutations(size: int) -> list[tuple[str, Any]]:
    flips = sorted({0, 1, size // 3, size // 2, size - 5, size - 1})
    cuts = sorted({0, 1, size // 2, size - 1})
    return [("flip", i) for i in flips] + [("truncate", n) for n in cuts] + [("delete", None)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Any, dict]:
    root = tmp_path_factory.mktemp("pristine")
    store = RolloutStore(str(root))
    store.write(
        RUN,
        SPLIT,
        ROLLOUT_ID,
        make_samples(n_prompts=3, per_prompt=2),
        n_samples_per_prompt=2,
        engine=ENGINE,
        config_hash="cfg-mutations",
        extra={"note": "original", "nested": {"steps": [1, 2]}},
    )
    original = store.load(RUN, SPLIT, ROLLOUT_ID)
    folder = Path(store.artifact_uri(RUN, SPLIT, ROLLOUT_ID).removeprefix("file://"))
    if not folder.is_dir():
        folder = root / RUN / "rollouts" / SPLIT / f"{ROLLOUT_ID:06d}"
    return folder, original, json.loads((folder / MANIFEST_NAME).read_text())


def load_outcome(root: Path) -> tuple[str, Any]:
    """('error', the named error) or ('loaded', (artifact, columns, samples)); anything else propagates."""
    store = RolloutStore(str(root))
    try:
        artifact = store.load(RUN, SPLIT, ROLLOUT_ID)
        return "loaded", (artifact, store.load_columns(RUN, SPLIT, ROLLOUT_ID), artifact.samples)
    except ArtifactError as exc:
        return "error", exc


def copy_of(pristine, tmp_path: Path) -> tuple[Path, Path]:
    folder, _, _ = pristine
    root = tmp_path / "root"
    target = root / RUN / "rollouts" / SPLIT / folder.name
    shutil.copytree(folder, target)
    return root, target


def assert_same_data(loaded: tuple, original, on_disk: dict | None) -> None:
    artifact, columns, samples = loaded
    assert artifact.columns == original.columns and columns == original.columns
    assert [s.to_dict() for s in samples] == [s.to_dict() for s in original.samples]
    for field in DATA_FIELDS:
        assert getattr(artifact.manifest, field) == getattr(original.manifest, field), field
    assert artifact.manifest.engine.weight_version == original.manifest.engine.weight_version
    assert [(f.name, artifact.manifest.file_format(f.name)) for f in artifact.manifest.files] == [
        (f.name, original.manifest.file_format(f.name)) for f in original.manifest.files
    ]
    if on_disk is not None:
        # no coercion and no defaults filled in: what loads is what is on disk
        assert artifact.manifest.model_dump(mode="json") == on_disk


def manifest_cases(doc: dict) -> list[tuple[tuple, Any]]:
    return [(path, value) for path in walk(doc) for value in VALUES]


def test_every_manifest_field_mutation_raises_a_named_error_or_loads_the_same_data(pristine, tmp_path):
    _, original, doc = pristine
    cases = manifest_cases(doc)
    # every field of the written manifest is reached, nested ones and the file entry included
    reached = {path for path, _ in cases}
    assert {("schema_version",), ("engine", "weight_version"), ("files", 0, "xxh3_128"), ("extra", "nested")} <= reached
    outcomes: dict[str, list] = {"error": [], "loaded": []}
    for i, (path, value) in enumerate(cases):
        root, folder = copy_of(pristine, tmp_path / f"m{i}")
        changed = mutated(doc, path, value)
        (folder / MANIFEST_NAME).write_text(json.dumps(changed))
        what = f"{'.'.join(map(str, path))} = {'<dropped>' if value is DROP else repr(value)}"
        try:
            kind, result = load_outcome(root)
        except Exception as exc:  # noqa: BLE001 - the assertion names the case
            pytest.fail(f"{what}: raised {type(exc).__name__}: {exc} (not one of the store's named errors)")
        if kind == "loaded":
            try:
                assert_same_data(result, original, changed)
            except AssertionError as exc:
                pytest.fail(f"{what}: loaded different data ({exc})")
        outcomes[kind].append(what)
    # the mutations bite: most of them are refused; what loads was a provenance field given a value of its type
    assert len(outcomes["error"]) > len(outcomes["loaded"])
    provenance = ("run", "created_at", "producer", "engine.backend", "engine.model", "config_hash", "extra")
    assert all(what.startswith(provenance) for what in outcomes["loaded"]), outcomes["loaded"]
    assert "schema_version = [1, 'x']" in outcomes["error"] and "schema_version = {}" in outcomes["error"]


def test_every_file_mutation_raises_a_named_error_or_loads_the_same_data(pristine, tmp_path):
    folder, original, _ = pristine
    cases = [(f.name, m) for f in sorted(folder.iterdir()) for m in file_mutations(f.stat().st_size)]
    assert {name for name, _ in cases} == {MANIFEST_NAME, "samples.parquet"}
    for i, (name, (how, at)) in enumerate(cases):
        root, target = copy_of(pristine, tmp_path / f"f{i}")
        path = target / name
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[at] ^= 0x01
            path.write_bytes(bytes(data))
        elif how == "truncate":
            path.write_bytes(bytes(data[:at]))
        else:
            path.unlink()
        what = f"{name}: {how} {at}"
        try:
            kind, result = load_outcome(root)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{what}: raised {type(exc).__name__}: {exc} (not one of the store's named errors)")
        if kind == "loaded":
            try:
                # a flipped bit in the manifest's JSON may land in provenance text: the data must still match
                assert_same_data(result, original, None)
            except AssertionError as exc:
                pytest.fail(f"{what}: loaded different data ({exc})")
        elif name == "samples.parquet":
            assert type(result).__name__ == "ArtifactCorrupt", what  # the checksum catches every payload change
