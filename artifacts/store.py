"""The rollout artifact store: fsspec-backed, write-once, checksum-verified.

Layout (DESIGN.md section 2)::

    {root}/{run}/rollouts/{split}/{rollout_id:06d}/manifest.json
                                                  /samples.parquet

Commit protocol: the payload is written first and the manifest last; only a manifest makes an
artifact exist, so a crash mid-write leaves an invisible, overwritable folder. Committed artifacts
are immutable and every load verifies sha256 + size of every payload file before parsing.

Samples travel as Arrow columns (columns.py): a write encodes them with pyarrow's parquet writer and
hashes the encoded bytes once; a load reads the file into Arrow memory, hashing each chunk as it
arrives, and decodes the columns natively. `Sample` objects are built only when asked for
(`RolloutArtifact.samples`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable
from typing import IO, Any

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from .codec import READABLE_FORMATS, PAYLOAD_FORMAT, arrow_owned, columns_from_parquet, columns_to_parquet
from .columns import SampleColumns
from .errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactExists,
    ArtifactNotFound,
    ArtifactSchemaError,
    StorageBucketNotFound,
    StorageError,
)
from .manifest import (
    EngineInfo,
    FileEntry,
    Manifest,
    ProducerInfo,
    producer_info,
    schema_error_from_validation,
)
from .sample import Sample
from .storage import endpoint_of, error_codes, is_s3, open_fs, storage_errors

MANIFEST_NAME = "manifest.json"
SAMPLES_NAME = "samples.parquet"
SPLITS = ("train", "eval")

_log = logging.getLogger(__name__)

_RUN_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_RUN_LEN = 200


# ----------------------------------------------------------------------------- names and URIs


def validate_run(run: Any) -> str:
    if not isinstance(run, str) or not run:
        raise ValueError(f"run={run!r}: the run name must be a non-empty string")
    if "/" in run or "\\" in run:
        raise ValueError(f"run={run!r}: the run name must not contain '/' (it is one folder under the root)")
    if ".." in run or run == ".":
        raise ValueError(f"run={run!r}: the run name must not be '.' or contain '..'")
    if not _RUN_RE.match(run) or len(run) > _MAX_RUN_LEN:
        raise ValueError(
            f"run={run!r}: use only letters, digits, '.', '_' and '-' (at most {_MAX_RUN_LEN} characters), "
            "e.g. 'grpo-qwen2-0.5b_seed1'"
        )
    return run


def validate_split(split: Any) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    return str(split)


def validate_rollout_id(rollout_id: Any) -> int:
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, int) or rollout_id < 0:
        raise ValueError(f"rollout_id={rollout_id!r}: expected an integer >= 0")
    return rollout_id


def normalize_root(root: str) -> str:
    """Canonical spelling of a root, so refs made from equal roots compare equal.

    Plain paths become absolute: an artifact URI is handed to other processes (Prefect tasks,
    Ray workers) whose working directory may differ.
    """
    if not isinstance(root, str) or not root.strip():
        raise ValueError(
            f"root={root!r}: expected a non-empty path or fsspec URL (file://, s3://, memory://)"
        )
    if "://" in root:
        protocol, rest = root.split("://", 1)
        return f"{protocol}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(root))


def join_uri(root: str, *parts: str) -> str:
    base = root if root.endswith("/") else root + "/"
    return base + "/".join(parts)


def _protocol(root: str) -> str:
    return root.split("://", 1)[0] if "://" in root else "file"


def _rollout_parts(run: str, split: str, rollout_id: int) -> tuple[str, ...]:
    return (run, "rollouts", split, f"{rollout_id:06d}")


# ----------------------------------------------------------------------------- refs and artifacts


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    """Where one committed rollout lives; small and JSON-able, so Prefect results can hold it."""

    root: str
    run: str
    split: str
    rollout_id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", normalize_root(self.root))
        validate_run(self.run)
        validate_split(self.split)
        validate_rollout_id(self.rollout_id)

    @property
    def uri(self) -> str:
        return join_uri(self.root, *_rollout_parts(self.run, self.split, self.rollout_id))

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "run": self.run, "split": self.split, "rollout_id": self.rollout_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArtifactRef":
        expected = {"root", "run", "split", "rollout_id"}
        missing, unknown = expected - set(data), set(data) - expected
        if missing or unknown:
            raise ValueError(
                f"ArtifactRef.from_dict: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                f"expected exactly {sorted(expected)}"
            )
        return cls(root=data["root"], run=data["run"], split=data["split"], rollout_id=data["rollout_id"])

    @classmethod
    def from_uri(cls, uri: str) -> "ArtifactRef":
        """Parse an artifact folder URI (or its manifest.json URI) back into a ref."""
        text = uri.rstrip("/")
        if text.endswith("/" + MANIFEST_NAME):
            text = text[: -len(MANIFEST_NAME) - 1]
        parts = text.split("/")
        layout = "{root}/{run}/rollouts/{split}/{rollout_id:06d}"
        if len(parts) < 5 or parts[-3] != "rollouts":
            raise ValueError(f"uri={uri!r} is not a rollout artifact folder; expected {layout}")
        run, _, split, id_text = parts[-4:]
        if not (id_text.isascii() and id_text.isdigit()):
            raise ValueError(
                f"uri={uri!r}: last component {id_text!r} is not a rollout id; expected {layout}"
            )
        root = text[: len(text) - len("/".join(parts[-4:]))]
        return cls(root=root, run=run, split=split, rollout_id=int(id_text))


class RolloutArtifact:
    """A manifest plus its samples, held as columns; `samples` materialises `Sample` objects on first use."""

    def __init__(self, manifest: Manifest, samples: list[Sample] | None = None, root: str | None = None, *,
                 columns: SampleColumns | None = None) -> None:
        if (samples is None) == (columns is None):
            raise ValueError("RolloutArtifact takes either samples or columns")
        self.manifest = manifest
        # Set by RolloutStore.load; an artifact assembled in memory has no location yet.
        self.root = root
        self._samples = samples
        self._columns = columns

    def __repr__(self) -> str:
        return (f"RolloutArtifact({self.manifest.split} rollout {self.manifest.rollout_id} of run "
                f"{self.manifest.run!r}, {self.manifest.n_samples} samples, root={self.root!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutArtifact):
            return NotImplemented
        return (self.manifest, self.root, self.columns) == (other.manifest, other.root, other.columns)

    @property
    def columns(self) -> SampleColumns:
        if self._columns is None:
            self._columns = SampleColumns.from_samples(self._samples or [])
        return self._columns

    @property
    def samples(self) -> list[Sample]:
        """`Sample` objects of every row, built on first access and kept (callers may edit them)."""
        if self._samples is None:
            try:
                self._samples = self.columns.to_samples()
            except ArtifactSchemaError as exc:
                uri = join_uri(self.ref.uri, SAMPLES_NAME) if self.root is not None else None
                raise ArtifactSchemaError(str(exc), field=exc.field, uri=uri) from None
        return self._samples

    def __len__(self) -> int:
        return self.manifest.n_samples

    @property
    def ref(self) -> ArtifactRef:
        if self.root is None:
            raise ValueError(
                "RolloutArtifact.ref: this artifact has no root (it was not loaded from a store); "
                "write it with RolloutStore.write to get a ref"
            )
        return ArtifactRef(self.root, self.manifest.run, self.manifest.split, self.manifest.rollout_id)


# ----------------------------------------------------------------------------- local-disk primitives


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_local_temp(path: str, data: bytes) -> str:
    """Write `data` durably to a unique hidden sibling of `path` and return its name."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return tmp


def _write_local_atomic(path: str, data: bytes) -> None:
    tmp = _write_local_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def _create_local_exclusive(path: str, data: bytes) -> bool:
    """Create `path` with `data` unless it exists; False if it did. Readers never see a partial file.

    A hard link of a complete temp file is both atomic and no-clobber. Filesystems without hard
    links fall back to O_EXCL, which is still exclusive but may expose a half-written file briefly.
    """
    tmp = _write_local_temp(path, data)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
    finally:
        _unlink_quiet(tmp)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return True


# ----------------------------------------------------------------------------- the store


class RolloutStore:
    """Rollout artifacts (and other run files) under one fsspec root.

    Storage options for the root come from the standard environment (artifacts/storage.py:
    `AWS_ENDPOINT_URL`, credentials through botocore's own chain) merged under `storage_options`.
    Storage failures surface as StorageError subclasses (StorageUnavailable is transient) whose
    messages name the endpoint, bucket and object and never contain credentials.

    Concurrency - of several writers of the same id exactly one commits; the others get
    ArtifactExists:
    - local disks: the manifest is created exclusively (hard link of a complete temp file);
    - S3: the manifest PUT carries `If-None-Match: *`, so the endpoint refuses a second one. An
      endpoint that rejects the header gets an existence check followed by a plain PUT (a
      warning is logged once): two writers racing inside that window could both "commit".
    The payload has a fixed name (samples.parquet), so it is guarded too: a fresh id's payload is
    created exclusively (the same two mechanisms), so concurrent writers are refused before they
    touch anything. A payload without a manifest is either a crashed write's leftover or another
    writer between its payload and its manifest: the writer waits `LEFTOVER_GRACE_S` for a
    manifest (ArtifactExists if one appears) and only then replaces the leftover (at once if the
    leftover holds its own bytes, as on a retry). Should a writer stall longer than that between
    payload and manifest, the winner re-checks its payload right after committing and writes it
    again if it was replaced; a loser landing even later is told so in its ArtifactExists message,
    and the manifest then fails its checksum on load (ArtifactCorrupt): detected, never read.
    """

    # Endpoints seen rejecting conditional PUTs (If-None-Match), so we warn and fall back once each.
    _no_conditional_put: set[str] = set()
    # How long a writer that finds someone else's uncommitted payload waits for that writer's manifest
    # before treating the payload as a crashed write's leftover.
    LEFTOVER_GRACE_S = 2.0

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = normalize_root(root)
        # Only what the caller passed; environment-derived options are recomputed in every process.
        self.storage_options = dict(storage_options or {})
        self._fs, self._base = open_fs(self.root, self.storage_options)
        self._local = isinstance(self._fs, LocalFileSystem)
        self._s3 = is_s3(self.root)
        self._producer: ProducerInfo | None = None

    def __repr__(self) -> str:
        return f"RolloutStore({self.root!r})"

    # -- paths

    def _path(self, *parts: str) -> str:
        return "/".join((self._base.rstrip("/"), *parts))

    def _artifact_path(self, run: str, split: str, rollout_id: int) -> str:
        return self._path(*_rollout_parts(run, split, rollout_id))

    def artifact_uri(self, run: str, split: str, rollout_id: int) -> str:
        return ArtifactRef(self.root, run, split, rollout_id).uri

    def run_uri(self, run: str) -> str:
        return join_uri(self.root, validate_run(run))

    def path_uri(self, rel: str) -> str:
        return join_uri(self.root, _validate_rel(rel))

    # -- low-level IO

    def _uri_of(self, path: str) -> str:
        """The URI of an fs path under this root (for messages)."""
        if self._local:
            return path
        base = self._base.rstrip("/")
        return join_uri(self.root, path[len(base) + 1 :]) if path.startswith(base + "/") else path

    def _guard(self, path: str, action: str):
        return storage_errors(self._uri_of(path), action, fs=self._fs, storage_options=self.storage_options)

    def _exists(self, path: str) -> bool:
        # Object-store filesystems cache listings; a stale cache would hide a fresh commit.
        with self._guard(path, "checking"):
            self._fs.invalidate_cache(path)
            return bool(self._fs.exists(path))

    def _cat(self, path: str, action: str = "reading") -> bytes:
        with self._guard(path, action):
            return self._fs.cat_file(path)

    def _put(self, path: str, data: bytes) -> str | None:
        """Write (replace) one file; returns the object's ETag where the store reports one."""
        if self._local:
            _write_local_atomic(path, data)
            return None
        with self._guard(path, "writing"):
            out = self._fs.pipe_file(path, data)
        return _etag(out)

    def check_access(self) -> None:
        """Fail early, with one clear StorageError, if the root's endpoint, credentials or bucket are wrong.

        One request (a bucket HEAD on S3); local and in-memory roots always pass.
        """
        if not self._s3:
            return
        bucket = self._base.split("/", 1)[0]
        endpoint = endpoint_of(self._fs, self.root)
        try:
            with storage_errors(self.root, "opening the artifact root", fs=self._fs,
                                storage_options=self.storage_options):
                self._fs.call_s3("head_bucket", Bucket=bucket)
        except StorageError:
            raise
        except FileNotFoundError:  # HEAD answers a bare 404, without the NoSuchBucket code
            raise StorageBucketNotFound(
                f"bucket {bucket!r} does not exist at {endpoint} (artifact root {self.root}); create it "
                f"(e.g. `aws s3 mb s3://{bucket}`) or fix store.root / AWS_ENDPOINT_URL",
                uri=self.root, endpoint=endpoint, bucket=bucket) from None

    def _producer_info(self) -> ProducerInfo:
        # Resolved once per store: it runs `git` and the answer cannot change within a process.
        if self._producer is None:
            self._producer = producer_info()
        return self._producer

    # -- rollout artifacts

    def write(
        self,
        run: str,
        split: str,
        rollout_id: int,
        samples: Iterable[Sample] | SampleColumns,
        *,
        n_samples_per_prompt: int,
        engine: EngineInfo,
        config_hash: str,
        extra: dict[str, Any] | None = None,
    ) -> ArtifactRef:
        """Commit one rollout (`Sample`s or, cheaper, `SampleColumns`). Raises ArtifactExists if this id
        is already committed."""
        ref = ArtifactRef(self.root, run, split, rollout_id)
        columns = samples if isinstance(samples, SampleColumns) else _columns_of(samples)
        invalid = columns.first_invalid()  # vectorized over the buffers, no per-token Python
        if invalid is not None:
            raise ArtifactSchemaError(f"samples[{invalid[0]}]: {invalid[1]}", field="samples")

        folder = self._artifact_path(run, split, rollout_id)
        manifest_path = f"{folder}/{MANIFEST_NAME}"
        # Encode first, so the existence check and the payload write follow each other closely
        # (the window in which a concurrent writer could slip in between stays one round trip).
        # The payload stays in Arrow memory for local writes; object stores' clients want bytes.
        encoded = columns_to_parquet(columns)
        payload: bytes | memoryview = memoryview(encoded) if self._local else encoded.to_pybytes()
        del encoded
        # Fail before any byte is written: a committed artifact's folder must never be touched.
        if self._exists(manifest_path):
            raise ArtifactExists(ref.uri)

        try:
            manifest = Manifest(
                run=run,
                rollout_id=rollout_id,
                split=split,  # type: ignore[arg-type]
                n_samples=len(columns),
                n_samples_per_prompt=n_samples_per_prompt,
                producer=self._producer_info(),
                engine=engine,
                config_hash=config_hash,
                files=[
                    FileEntry(
                        name=SAMPLES_NAME, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
                        format=PAYLOAD_FORMAT,
                    )
                ],
                extra=extra or {},
            )
            manifest_bytes = manifest.to_json_bytes()
        except ValidationError as exc:
            raise schema_error_from_validation(exc, uri=ref.uri) from None
        except PydanticSerializationError as exc:
            raise ArtifactSchemaError(
                f"extra is not JSON-serializable ({exc}); use JSON types only", field="extra", uri=ref.uri
            ) from None

        # A fresh id gets its payload created exclusively, so of concurrent writers only one gets
        # past this point. A payload without a manifest is a crashed write's leftover (replacing it is
        # safe) or another writer between its payload and its manifest: give that one time to commit.
        payload_path = f"{folder}/{SAMPLES_NAME}"
        fresh = not self._exists(payload_path)
        if not fresh and not self._is_our_payload(payload_path, payload):
            self._wait_for_other_writer(manifest_path, uri=ref.uri)
        try:
            etag = self._write_payload(payload_path, payload, fresh=fresh, uri=ref.uri)
        except ArtifactExists:
            if self._exists(manifest_path):
                raise ArtifactExists(ref.uri) from None  # committed meanwhile: say so plainly
            raise
        try:
            self._commit_manifest(manifest_path, manifest_bytes, uri=ref.uri)
        except ArtifactExists as exc:
            raise self._lost_race(exc, payload_path, payload, etag) from None
        self._repair_payload_after_commit(payload_path, payload, etag)
        return ref

    def _commit_manifest(self, path: str, data: bytes, *, uri: str) -> None:
        """The commit point: after this returns the artifact exists. ArtifactExists if it already did."""
        if self._local:
            if not _create_local_exclusive(path, data):
                raise ArtifactExists(uri)
            return
        if self._s3 and self._put_if_absent(path, data, uri=uri) is not None:
            return
        # No create-if-absent on this filesystem: check, then put (racy between the two calls).
        if self._exists(path):
            raise ArtifactExists(uri)
        self._put(path, data)

    def _is_our_payload(self, path: str, payload: bytes) -> bool:
        """The leftover holds exactly these bytes (a retry of the same write): no one to wait for."""
        try:
            tag = self._payload_tag(path)
        except StorageError:
            raise
        except Exception:  # noqa: BLE001 - unknown means "not ours"
            return False
        if tag is None:
            return False
        if self._local:
            return tag == hashlib.sha256(payload).hexdigest()
        # S3's ETag of a single-part, non-KMS upload is the MD5 of the bytes.
        return tag == hashlib.md5(payload, usedforsecurity=False).hexdigest()

    def _wait_for_other_writer(self, manifest_path: str, *, uri: str) -> None:
        """Poll for `LEFTOVER_GRACE_S`: a concurrent writer's manifest follows its payload within a
        request; a crashed writer's never comes (then the caller replaces the leftover)."""
        deadline = time.monotonic() + self.LEFTOVER_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self._exists(manifest_path):
                raise ArtifactExists(uri)

    def _write_payload(self, path: str, data: bytes, *, fresh: bool, uri: str) -> str | None:
        """Write the payload; exclusively when the id looked fresh. Returns the ETag if known."""
        if fresh:
            if self._local:
                if not _create_local_exclusive(path, data):
                    raise ArtifactExists(uri, in_progress=True)
                return None
            if self._s3:
                out = self._put_if_absent(path, data, uri=uri, in_progress=True)
                if out is not None:
                    return _etag(out)
        return self._put(path, data)

    def _put_if_absent(self, path: str, data: bytes, *, uri: str, in_progress: bool = False) -> dict | None:
        """S3 PutObject with `If-None-Match: *`: PutObject's answer once written; ArtifactExists if the
        key exists; None if the endpoint does not support conditional writes (the caller falls back)."""
        endpoint = endpoint_of(self._fs, self.root)
        if endpoint in RolloutStore._no_conditional_put:
            return None
        bucket, key = path.split("/", 1)
        for attempt in range(4):
            try:
                with self._guard(path, "writing"):
                    try:
                        out = self._fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                    finally:
                        self._fs.invalidate_cache(path)
                return out if isinstance(out, dict) else {}
            except StorageError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised if unknown
                codes = error_codes(exc)
                if isinstance(exc, FileExistsError) or codes & {"PreconditionFailed", "412"}:
                    raise ArtifactExists(uri, in_progress=in_progress) from None
                if codes & {"ConditionalRequestConflict", "409"} and attempt < 3:
                    # Another conditional write of this key is in flight: ask again shortly.
                    time.sleep(0.2 * (attempt + 1))
                    continue
                if _rejects_conditional_put(exc, codes):
                    RolloutStore._no_conditional_put.add(endpoint)
                    _log.warning(
                        "the object store at %s rejects conditional writes (If-None-Match) (%s); falling "
                        "back to check-then-put: two writers of the same rollout id racing within one "
                        "request of each other could both commit", endpoint, type(exc).__name__)
                    return None
                raise
        raise ArtifactExists(uri, in_progress=in_progress)

    def _payload_tag(self, path: str) -> str | None:
        """The stored payload's identity: ETag on object stores, sha256 on local disks."""
        try:
            if self._local:
                with open(path, "rb") as fh:
                    return hashlib.sha256(fh.read()).hexdigest()
            with self._guard(path, "checking"):
                self._fs.invalidate_cache(path)
                return _etag(self._fs.info(path))
        except FileNotFoundError:
            return None

    def _repair_payload_after_commit(self, path: str, payload: bytes, etag: str | None) -> None:
        """After winning the commit, make sure the payload is still ours (a racing loser may have
        replaced it between our payload write and our manifest); write it again if not."""
        ours = hashlib.sha256(payload).hexdigest() if self._local else etag
        if ours is None:
            return  # no cheap identity on this filesystem (memory://): nothing to compare
        current = self._payload_tag(path)
        if current != ours:
            _log.warning("payload %s was replaced by a concurrent writer of the same rollout id "
                         "before this commit; writing the committed payload again", self._uri_of(path))
            self._put(path, payload)

    def _lost_race(self, exc: ArtifactExists, path: str, payload: bytes, etag: str | None) -> ArtifactExists:
        """ArtifactExists for a writer that lost the commit after writing its payload."""
        ours = hashlib.sha256(payload).hexdigest() if self._local else etag
        try:
            clobbered = ours is not None and self._payload_tag(path) == ours
        except Exception:  # noqa: BLE001 - the refusal matters more than this diagnosis
            clobbered = False
        if not clobbered:
            return exc
        return ArtifactExists(exc.uri, note=(
            "This writer lost a race with a concurrent writer of the same id and its payload replaced the "
            "committed one afterwards: loading the artifact will fail its checksum (ArtifactCorrupt); "
            "regenerate it. Give concurrent runs distinct run names."))

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
        """The file's bytes in Arrow memory, sha256 + size checked (ArtifactCorrupt otherwise)."""
        path = f"{folder}/{entry.name}"
        try:
            if self._local:
                data, actual_sha = _read_local_hashed(path)
            else:
                raw = self._cat(path)
                actual_sha = hashlib.sha256(raw).hexdigest()
                data = arrow_owned(raw)  # one copy; the Python bytes are dropped right after
                del raw
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise ArtifactCorrupt(
                file_uri,
                expected_sha256=entry.sha256,
                actual_sha256=None,
                expected_size=entry.size,
                actual_size=None,
            ) from None
        if data.size != entry.size or actual_sha != entry.sha256:
            raise ArtifactCorrupt(
                file_uri,
                expected_sha256=entry.sha256,
                actual_sha256=actual_sha,
                expected_size=entry.size,
                actual_size=data.size,
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
                "version", field="files", uri=uri)
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

    def load_uri(self, uri: str) -> RolloutArtifact:
        """Load from an artifact folder URI (ArtifactRef.uri), possibly under another root."""
        ref = ArtifactRef.from_uri(uri)
        if ref.root == self.root:
            return self.load(ref.run, ref.split, ref.rollout_id)
        # Credentials only make sense for the same kind of filesystem.
        options = self.storage_options if _protocol(ref.root) == _protocol(self.root) else None
        return RolloutStore(ref.root, options).load(ref.run, ref.split, ref.rollout_id)

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
            if entry.get("type") == "directory" and _is_valid_run(name):
                runs.append(name)
        return sorted(runs)

    # -- generic run files (checkpoints index, metrics, reports): paths relative to the root

    def open(self, rel: str, mode: str = "rb") -> IO[Any]:
        path = self._path(_validate_rel(rel))
        if self._local and any(flag in mode for flag in "wax"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return self._fs.open(path, mode)

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write (replace) a run file; atomic on local disks. Returns its URI."""
        self._put(self._path(_validate_rel(rel)), data)
        return self.path_uri(rel)

    def create_bytes(self, rel: str, data: bytes) -> bool:
        """Commit a run file only if it does not exist yet: the rollouts' commit point, for other markers
        (checkpoints' meta.json). Atomic and no-clobber on local disks (hard link of a complete temp
        file), a conditional PUT (`If-None-Match: *`) on S3. Returns False if the file already existed."""
        path = self._path(_validate_rel(rel))
        try:
            self._commit_manifest(path, data, uri=self.path_uri(rel))
        except ArtifactExists:
            return False
        return True

    def delete_path(self, rel: str) -> None:
        """Remove a run file if it exists (e.g. a commit marker being withdrawn before its payload is replaced)."""
        path = self._path(_validate_rel(rel))
        with self._guard(path, "deleting"):
            try:
                self._fs.rm_file(path)
            except FileNotFoundError:
                pass
            self._fs.invalidate_cache(path)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self._cat(self._path(_validate_rel(rel)))
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no file {rel!r} under root {self.root!r} ({self.path_uri(rel)})"
            ) from None

    def exists_path(self, rel: str) -> bool:
        return self._exists(self._path(_validate_rel(rel)))


def _columns_of(samples: Iterable[Sample]) -> SampleColumns:
    samples = list(samples)
    for position, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise ArtifactSchemaError(
                f"samples[{position}] is a {type(sample).__name__}, expected artifacts.Sample "
                "(build one with Sample(...) or Sample.from_dict)",
                field="samples",
            )
    try:
        return SampleColumns.from_samples(samples)
    except ArtifactSchemaError:
        # A sample that breaks the contract may also fail to convert (e.g. a str in tokens): report the
        # contract's own message first, as before columns existed.
        for position, sample in enumerate(samples):
            try:
                sample.validate()
            except (ValueError, TypeError) as exc:
                raise ArtifactSchemaError(f"samples[{position}]: {exc}", field="samples") from None
        raise


_READ_CHUNK = 8 << 20


def _read_local_hashed(path: str) -> tuple[pa.Buffer, str]:
    """A local file read straight into Arrow memory, hashed chunk by chunk while each is still in cache."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        buf = pa.allocate_buffer(size, memory_pool=pa.system_memory_pool())  # see codec.arrow_owned
        view = memoryview(buf).cast("B") if size else memoryview(b"")
        done = 0
        while done < size:
            got = fh.readinto(view[done : min(size, done + _READ_CHUNK)])
            if not got:
                break  # the file shrank under us: the size check reports it
            digest.update(view[done : done + got])
            done += got
    return (buf if done == size else buf.slice(0, done)), digest.hexdigest()


def _is_valid_run(name: str) -> bool:
    try:
        validate_run(name)
    except ValueError:
        return False
    return True


def _validate_rel(rel: Any) -> str:
    if not isinstance(rel, str) or not rel:
        raise ValueError(f"path={rel!r}: expected a non-empty path relative to the store root")
    parts = rel.split("/")
    if rel.startswith("/") or "://" in rel or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"path={rel!r}: expected a relative path like '<run>/metrics.json' (no leading '/', "
            "no empty, '.' or '..' components, no URL scheme)"
        )
    return rel


def _etag(info: Any) -> str | None:
    """The ETag in an S3 PutObject / HeadObject / fsspec info answer, if any."""
    if isinstance(info, dict):
        value = info.get("ETag") or info.get("etag")
        if value:
            return str(value).strip('"')
    return None


def _rejects_conditional_put(exc: BaseException, codes: set[str]) -> bool:
    """The endpoint (or an old botocore) does not support If-None-Match on PutObject."""
    if type(exc).__name__ == "ParamValidationError" or "IfNoneMatch" in str(exc):
        return True  # botocore too old to know the parameter
    if codes & {"NotImplemented", "501", "InvalidArgument", "InvalidRequest", "BadRequest", "400"}:
        return True
    return isinstance(exc, NotImplementedError)
