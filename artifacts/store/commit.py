"""The commit protocol: payload first, manifest last, and only a manifest makes an artifact exist.

Concurrent writers of one id are refused before they touch anything (an exclusive create of the payload, then of
the manifest: a hard link on local disks, `If-None-Match: *` on S3); `RolloutStore`'s docstring tells the whole
story, including the fallback for endpoints without conditional writes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from ..codec import PAYLOAD_FORMAT, columns_to_parquet
from ..columns import SampleColumns
from ..digests import INTEGRITY_ALGORITHM, hexdigest
from ..errors import ArtifactExists, ArtifactSchemaError, StorageError
from ..manifest import EngineInfo, FileEntry, Manifest, schema_error_from_validation
from ..sample import Sample
from ..storage import endpoint_of, error_codes
from .base import StoreBase, etag_of
from .localfs import create_local_exclusive, hash_local_file
from .refs import MANIFEST_NAME, SAMPLES_NAME, ArtifactRef

_log = logging.getLogger(__name__)


class CommitProtocol(StoreBase):
    """Write-once rollouts (`write`) and the exclusive create behind every commit point (`_commit_manifest`)."""

    # Endpoints seen rejecting conditional PUTs (If-None-Match), so we warn and fall back once each.
    _no_conditional_put: set[str] = set()
    # How long a writer that finds someone else's uncommitted payload waits for that writer's manifest
    # before treating the payload as a crashed write's leftover.
    LEFTOVER_GRACE_S = 2.0

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
        # Hashed once; the same digest identifies our payload in the race checks below (local disks).
        digest = hexdigest(payload, INTEGRITY_ALGORITHM)
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
                        name=SAMPLES_NAME,
                        xxh3_128=digest,
                        size=len(payload),
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
        if not fresh and not self._is_our_payload(payload_path, payload, digest):
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
            raise self._lost_race(exc, payload_path, digest, etag) from None
        self._repair_payload_after_commit(payload_path, payload, digest, etag)
        return ref

    def _commit_manifest(self, path: str, data: bytes, *, uri: str) -> None:
        """The commit point: after this returns the artifact exists. ArtifactExists if it already did."""
        if self._local:
            if not create_local_exclusive(path, data):
                raise ArtifactExists(uri)
            return
        if self._s3 and self._put_if_absent(path, data, uri=uri) is not None:
            return
        # No create-if-absent on this filesystem: check, then put (racy between the two calls).
        if self._exists(path):
            raise ArtifactExists(uri)
        self._put(path, data)

    def _is_our_payload(self, path: str, payload: bytes | memoryview, digest: str) -> bool:
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
            return tag == digest
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
                if not create_local_exclusive(path, data):
                    raise ArtifactExists(uri, in_progress=True)
                return None
            if self._s3:
                out = self._put_if_absent(path, data, uri=uri, in_progress=True)
                if out is not None:
                    return etag_of(out)
        return self._put(path, data)

    def _put_if_absent(self, path: str, data: bytes, *, uri: str, in_progress: bool = False) -> dict | None:
        """S3 PutObject with `If-None-Match: *`: PutObject's answer once written; ArtifactExists if the
        key exists; None if the endpoint does not support conditional writes (the caller falls back)."""
        endpoint = endpoint_of(self._fs, self.root)
        if endpoint in self._no_conditional_put:
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
                    self._no_conditional_put.add(endpoint)
                    _log.warning(
                        "the object store at %s rejects conditional writes (If-None-Match) (%s); falling "
                        "back to check-then-put: two writers of the same rollout id racing within one "
                        "request of each other could both commit",
                        endpoint,
                        type(exc).__name__,
                    )
                    return None
                raise
        raise ArtifactExists(uri, in_progress=in_progress)

    def _payload_tag(self, path: str) -> str | None:
        """The stored payload's identity: ETag on object stores, its integrity digest on local disks."""
        try:
            if self._local:
                return hash_local_file(path, INTEGRITY_ALGORITHM)
            with self._guard(path, "checking"):
                self._fs.invalidate_cache(path)
                return etag_of(self._fs.info(path))
        except FileNotFoundError:
            return None

    def _repair_payload_after_commit(
        self, path: str, payload: bytes | memoryview, digest: str, etag: str | None
    ) -> None:
        """After winning the commit, make sure the payload is still ours (a racing loser may have
        replaced it between our payload write and our manifest); write it again if not."""
        ours = digest if self._local else etag
        if ours is None:
            return  # no cheap identity on this filesystem (memory://): nothing to compare
        current = self._payload_tag(path)
        if current != ours:
            _log.warning(
                "payload %s was replaced by a concurrent writer of the same rollout id "
                "before this commit; writing the committed payload again",
                self._uri_of(path),
            )
            self._put(path, payload)

    def _lost_race(self, exc: ArtifactExists, path: str, digest: str, etag: str | None) -> ArtifactExists:
        """ArtifactExists for a writer that lost the commit after writing its payload."""
        ours = digest if self._local else etag
        try:
            clobbered = ours is not None and self._payload_tag(path) == ours
        except Exception:  # noqa: BLE001 - the refusal matters more than this diagnosis
            clobbered = False
        if not clobbered:
            return exc
        return ArtifactExists(
            exc.uri,
            note=(
                "This writer lost a race with a concurrent writer of the same id and its payload replaced the "
                "committed one afterwards: loading the artifact will fail its checksum (ArtifactCorrupt); "
                "regenerate it. Give concurrent runs distinct run names."
            ),
        )


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


def _rejects_conditional_put(exc: BaseException, codes: set[str]) -> bool:
    """The endpoint (or an old botocore) does not support If-None-Match on PutObject."""
    if type(exc).__name__ == "ParamValidationError" or "IfNoneMatch" in str(exc):
        return True  # botocore too old to know the parameter
    if codes & {"NotImplemented", "501", "InvalidArgument", "InvalidRequest", "BadRequest", "400"}:
        return True
    return isinstance(exc, NotImplementedError)
