"""Errors raised by the artifact store.

Every message names what was wrong (file, field, run, id) and how to fix it, because these errors
surface in Prefect's UI far away from the code that caused them. The classes also derive from the
matching builtin (FileNotFoundError, FileExistsError, ValueError) so generic callers still work.
"""

from __future__ import annotations

from collections.abc import Iterable


class ArtifactError(Exception):
    """Base class of every error raised by `artifacts`."""


def format_ids(ids: Iterable[int]) -> str:
    """Compact listing of ids ("0-99, 120, 122-130"): a run can hold thousands of rollouts."""
    ordered = sorted(set(ids))
    if not ordered:
        return "none"
    spans: list[str] = []
    start = prev = ordered[0]
    for value in ordered[1:]:
        if value == prev + 1:
            prev = value
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = value
    spans.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(spans)


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """No committed artifact (no manifest) at the requested run/split/rollout id."""

    def __init__(
        self,
        message: str,
        *,
        root: str | None = None,
        run: str | None = None,
        split: str | None = None,
        rollout_id: int | None = None,
        existing_ids: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.root = root
        self.run = run
        self.split = split
        self.rollout_id = rollout_id
        self.existing_ids = existing_ids or []

    def __str__(self) -> str:
        # OSError's __str__ would prefix an errno; keep the plain message.
        return str(self.args[0]) if self.args else ""

    @classmethod
    def for_rollout(
        cls,
        *,
        root: str,
        run: str,
        split: str,
        rollout_id: int,
        existing_ids: list[int],
        existing_runs: list[str] | None = None,
    ) -> "ArtifactNotFound":
        if existing_ids:
            hint = f"committed {split} rollout ids of run {run!r}: {format_ids(existing_ids)}"
        else:
            runs = ", ".join(repr(r) for r in existing_runs or []) or "none"
            hint = (
                f"run {run!r} has no committed {split} rollouts under this root (runs there: {runs}); "
                "check the run name, split and root, or run the rollout first"
            )
        return cls(
            f"no {split} rollout artifact {rollout_id} for run {run!r} under root {root!r}: "
            f"manifest.json is missing (an artifact exists only once its manifest is committed); {hint}",
            root=root,
            run=run,
            split=split,
            rollout_id=rollout_id,
            existing_ids=existing_ids,
        )


class ArtifactCorrupt(ArtifactError):
    """A payload file does not match the digest/size its manifest recorded (`algorithm`: the manifest's
    integrity hash, "xxh3_128" from manifest schema 3 on, "sha256" before)."""

    def __init__(
        self,
        uri: str,
        *,
        expected_digest: str,
        actual_digest: str | None,
        expected_size: int,
        actual_size: int | None,
        algorithm: str = "sha256",
    ) -> None:
        self.uri = uri
        self.algorithm = algorithm
        self.expected_digest = expected_digest
        self.actual_digest = actual_digest
        self.expected_size = expected_size
        self.actual_size = actual_size
        if actual_size is None:
            found = "the file is missing"
        else:
            found = f"found {algorithm}={actual_digest} size={actual_size}"
        super().__init__(
            f"checksum mismatch for {uri}: manifest expects {algorithm}={expected_digest} "
            f"size={expected_size}, {found}. The artifact is damaged (partial copy, disk error or "
            "edited by hand); committed artifacts are never repaired in place: regenerate it "
            "(rerun the rollout into a new run or id) or restore the folder from a backup copy."
        )

    def __reduce__(self):
        # Keyword-only fields: the default exception pickling would fail across Ray/Prefect processes.
        return (
            _rebuild_kw,
            (
                type(self),
                (self.uri,),
                {
                    "expected_digest": self.expected_digest,
                    "actual_digest": self.actual_digest,
                    "expected_size": self.expected_size,
                    "actual_size": self.actual_size,
                    "algorithm": self.algorithm,
                },
            ),
        )


class ArtifactExists(ArtifactError, FileExistsError):
    """A write targeted a rollout id whose manifest is already committed."""

    def __init__(self, uri: str, *, note: str | None = None, in_progress: bool = False) -> None:
        self.uri = uri
        self.note = note
        self.in_progress = in_progress
        state = (
            "is being written by another writer right now (its payload appeared after this writer "
            "checked the id was free)"
            if in_progress
            else "is already committed (manifest.json exists)"
        )
        super().__init__(
            f"rollout artifact {uri} {state} and committed "
            "artifacts are immutable: write the new data under a new rollout id, or start a new "
            "version of the run under another run name (e.g. '<run>-v2'); to really replace it, "
            "delete the folder yourself first." + (f" {note}" if note else "")
        )

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (_rebuild_kw, (type(self), (self.uri,), {"note": self.note, "in_progress": self.in_progress}))


class ArtifactSchemaError(ArtifactError, ValueError):
    """Manifest or parquet content (or a sample being written) breaks the data contract."""

    def __init__(self, message: str, *, field: str | None = None, uri: str | None = None) -> None:
        self.field = field
        self.uri = uri
        self._message = message
        where = f"{uri}: " if uri else ""
        super().__init__(f"{where}{message}")

    def __reduce__(self):
        return (
            _rebuild_kw,
            (type(self), (getattr(self, "_message", str(self)),), {"field": self.field, "uri": self.uri}),
        )


def _rebuild_kw(cls, args, kwargs):
    return cls(*args, **kwargs)


class StorageError(ArtifactError, OSError):
    """The storage behind a root failed (endpoint, credentials, bucket), not the artifact's content.

    `transient` says whether retrying may help (Prefect tasks retry on transient ones only). The
    message names the endpoint, bucket and object and never contains credentials.
    """

    transient = False

    def __init__(
        self, message: str, *, uri: str | None = None, endpoint: str | None = None, bucket: str | None = None
    ) -> None:
        super().__init__(message)
        self.uri = uri
        self.endpoint = endpoint
        self.bucket = bucket

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        # Picklable with its keyword fields (errors cross Ray and Prefect process boundaries).
        return (_rebuild_storage_error, (type(self), str(self), self.uri, self.endpoint, self.bucket))


def _rebuild_storage_error(cls, message, uri, endpoint, bucket):
    return cls(message, uri=uri, endpoint=endpoint, bucket=bucket)


class StorageUnavailable(StorageError, ConnectionError):
    """The endpoint did not answer (down, unreachable, timing out, overloaded): worth a retry."""

    transient = True


class StorageAuthError(StorageError, PermissionError):
    """Credentials missing, wrong or without access to the bucket."""


class StorageBucketNotFound(StorageError, FileNotFoundError):
    """The root's bucket does not exist at the endpoint."""
