"""Reading committed rollouts: the manifest checked against where it is stored, every payload's digest and
size verified before anything is parsed, the columns decoded natively; and listing what is committed."""

from __future__ import annotations

import pyarrow as pa

from ..codec import READABLE_FORMATS, arrow_owned, columns_from_parquet
from ..columns import SampleColumns
from ..digests import hexdigest
from ..errors import ArtifactCorrupt, ArtifactError, ArtifactNotFound, ArtifactSchemaError, StorageError
from ..manifest import FileEntry, Manifest
from .artifact import RolloutArtifact
from .base import StoreBase
from .localfs import read_local_hashed
from .refs import MANIFEST_NAME, SAMPLES_NAME, ArtifactRef, is_valid_run, join_uri, validate_run, validate_split


class VerifiedReads(StoreBase):
    """`load` and its columnar variants, `manifest`, `exists`, `list_ids`, `list_runs`."""

    def manifest(self, run: str, split: str, rollout_id: int) -> Manifest:
        ref = ArtifactRef(self.root, run, split, rollout_id)
        path = f"{self._artifact_path(run, split, rollout_id)}/{MANIFEST_NAME}"
        try:
            data = self._cat(path)
        except ArtifactError:
            raise
        except FileNotFoundError:
            existing_ids = self.list_ids(run, split)
            raise ArtifactNotFound.for_rollout(
                root=self.root,
                run=run,
                split=split,
                rollout_id=rollout_id,
                existing_ids=existing_ids,
                # A typo in the run name is the usual cause when the run has nothing at all.
                existing_runs=None if existing_ids else self.list_runs(),
            ) from None
        manifest_uri = join_uri(ref.uri, MANIFEST_NAME)
        manifest = Manifest.from_json_bytes(data, uri=manifest_uri)
        # The run name is not checked: copying a run folder under a new name is legitimate, while
        # a split or id mismatch means a training step would consume the wrong rollout.
        checks = (("split", manifest.split, split), ("rollout_id", manifest.rollout_id, rollout_id))
        for field, found, wanted in checks:
            if found != wanted:
                raise ArtifactSchemaError(
                    f"manifest says {field}={found!r} but it is stored at {field}={wanted!r}; the folder "
                    "was moved or copied by hand: move it back or regenerate the rollout",
                    field=field,
                    uri=manifest_uri,
                )
        return manifest

    def _read_verified(self, folder: str, entry: FileEntry, file_uri: str) -> pa.Buffer:
        """The file's bytes in Arrow memory, digest + size checked (ArtifactCorrupt otherwise). The digest is the
        one the manifest recorded: xxh3-128 from schema 3 on, sha256 in older artifacts."""
        path = f"{folder}/{entry.name}"
        algorithm, expected = entry.integrity
        try:
            if self._local:
                data, actual = read_local_hashed(path, algorithm)
            else:
                raw = self._cat(path)
                actual = hexdigest(raw, algorithm)
                data = arrow_owned(raw)  # one copy; the Python bytes are dropped right after
                del raw
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise ArtifactCorrupt(
                file_uri,
                expected_digest=expected,
                actual_digest=None,
                expected_size=entry.size,
                actual_size=None,
                algorithm=algorithm,
            ) from None
        if data.size != entry.size or actual != expected:
            raise ArtifactCorrupt(
                file_uri,
                expected_digest=expected,
                actual_digest=actual,
                expected_size=entry.size,
                actual_size=data.size,
                algorithm=algorithm,
            )
        return data

    def _verified_samples_payload(self, run: str, split: str, rollout_id: int) -> tuple[Manifest, str, pa.Buffer]:
        """(manifest, artifact URI, samples payload), every payload checksum verified first."""
        manifest = self.manifest(run, split, rollout_id)
        uri = self.artifact_uri(run, split, rollout_id)
        folder = self._artifact_path(run, split, rollout_id)
        entry = manifest.file(SAMPLES_NAME)
        payloads = {e.name: self._read_verified(folder, e, join_uri(uri, e.name)) for e in manifest.files}
        fmt = manifest.file_format(SAMPLES_NAME)
        if fmt not in READABLE_FORMATS:
            raise ArtifactSchemaError(
                f"{SAMPLES_NAME} is in payload format {fmt!r}, which this rollflow cannot read (it reads "
                f"{', '.join(sorted(READABLE_FORMATS))}); upgrade rollflow to read artifacts written by a newer "
                "version",
                field="files",
                uri=uri,
            )
        return manifest, uri, payloads[entry.name]

    @staticmethod
    def _check_rows(manifest: Manifest, rows: int, uri: str) -> None:
        if rows != manifest.n_samples:
            raise ArtifactSchemaError(
                f"manifest says n_samples={manifest.n_samples} but {SAMPLES_NAME} holds {rows} rows",
                field="n_samples",
                uri=uri,
            )

    def load(self, run: str, split: str, rollout_id: int) -> RolloutArtifact:
        """Read a committed rollout, verifying every payload checksum before parsing anything. The samples
        are held as columns; `artifact.samples` builds `Sample` objects only when first used."""
        manifest, columns = self._load_columns(run, split, rollout_id)
        return RolloutArtifact(manifest=manifest, columns=columns, root=self.root)

    def load_columns(self, run: str, split: str, rollout_id: int) -> SampleColumns:
        """A committed rollout's samples as columns (the trainer's batch, `rollflow show`), with `load`'s checks."""
        return self._load_columns(run, split, rollout_id)[1]

    def load_table(self, run: str, split: str, rollout_id: int) -> pa.Table:
        """A committed rollout's samples as a pyarrow table (columnar readers: `rollflow show`, pandas,
        duckdb), with the same checks as `load`: checksums verified before parsing, schema and row
        count checked; no `Sample` objects are built."""
        return self._load_columns(run, split, rollout_id)[1].table

    def _load_columns(self, run: str, split: str, rollout_id: int) -> tuple[Manifest, SampleColumns]:
        manifest, uri, payload = self._verified_samples_payload(run, split, rollout_id)
        try:
            columns = columns_from_parquet(payload)
        except ArtifactSchemaError as exc:
            raise ArtifactSchemaError(str(exc), field=exc.field, uri=join_uri(uri, SAMPLES_NAME)) from None
        # The encoded bytes are not needed once decoded: freeing them returns their pages to the OS at once
        # (they come from the system allocator), so what follows (a train batch, show's metrics) reuses them.
        del payload
        # Arrow's allocator keeps the decoder's freed scratch buffers (hundreds of MB for a large rollout)
        # for reuse by Arrow only; hand them back so numpy/torch (the train batch) can have those pages.
        pa.default_memory_pool().release_unused()
        self._check_rows(manifest, len(columns), uri)
        return manifest, columns

    def exists(self, run: str, split: str, rollout_id: int) -> bool:
        ArtifactRef(self.root, run, split, rollout_id)
        return self._exists(f"{self._artifact_path(run, split, rollout_id)}/{MANIFEST_NAME}")

    def list_ids(self, run: str, split: str) -> list[int]:
        """Committed rollout ids, ascending. Folders without a manifest (crashed writes) are skipped."""
        validate_run(run)
        validate_split(split)
        split_dir = self._path(run, "rollouts", split)
        self._fs.invalidate_cache(split_dir)
        try:
            # One recursive listing (a single LIST on object stores) instead of one HEAD per id;
            # `find` rather than `glob` because a root may contain glob metacharacters.
            with self._guard(split_dir, "listing"):
                found = self._fs.find(split_dir, maxdepth=2)
        except StorageError:
            raise
        except FileNotFoundError:
            return []
        ids = set()
        for path in found:
            parts = path.rstrip("/").split("/")
            if len(parts) >= 2 and parts[-1] == MANIFEST_NAME and parts[-2].isascii() and parts[-2].isdigit():
                ids.add(int(parts[-2]))
        return sorted(ids)

    def list_runs(self) -> list[str]:
        """Run folders under the root (any run with files, committed rollouts or not)."""
        base = self._base.rstrip("/") or "/"
        self._fs.invalidate_cache(base)
        try:
            with self._guard(base, "listing"):
                entries = self._fs.ls(base, detail=True)
        except StorageError:
            raise
        except FileNotFoundError:
            return []
        runs = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "directory" and is_valid_run(name):
                runs.append(name)
        return sorted(runs)
