"""`StoreBase`: one fsspec root opened, its paths and URIs, the guarded low-level reads and writes, and the
access check; what the commit protocol and the verified reads build on."""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageBucketNotFound, StorageError
from ..manifest import ProducerInfo, producer_info
from ..storage import endpoint_of, is_s3, open_fs, storage_errors
from .localfs import write_local_atomic
from .refs import ArtifactRef, join_uri, normalize_root, rollout_parts, validate_rel, validate_run


class StoreBase:
    """The root, its filesystem and the primitives every store operation goes through."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = normalize_root(root)
        # Only what the caller passed; environment-derived options are recomputed in every process.
        self.storage_options = dict(storage_options or {})
        self._fs, self._base = open_fs(self.root, self.storage_options)
        self._local = isinstance(self._fs, LocalFileSystem)
        self._s3 = is_s3(self.root)
        self._producer: ProducerInfo | None = None

    # -- paths

    def _path(self, *parts: str) -> str:
        return "/".join((self._base.rstrip("/"), *parts))

    def _artifact_path(self, run: str, split: str, rollout_id: int) -> str:
        return self._path(*rollout_parts(run, split, rollout_id))

    def artifact_uri(self, run: str, split: str, rollout_id: int) -> str:
        return ArtifactRef(self.root, run, split, rollout_id).uri

    def run_uri(self, run: str) -> str:
        return join_uri(self.root, validate_run(run))

    def path_uri(self, rel: str) -> str:
        return join_uri(self.root, validate_rel(rel))

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
            write_local_atomic(path, data)
            return None
        with self._guard(path, "writing"):
            out = self._fs.pipe_file(path, data)
        return etag_of(out)

    def check_access(self) -> None:
        """Fail early, with one clear StorageError, if the root's endpoint, credentials or bucket are wrong.

        One request (a bucket HEAD on S3); local and in-memory roots always pass.
        """
        if not self._s3:
            return
        bucket = self._base.split("/", 1)[0]
        endpoint = endpoint_of(self._fs, self.root)
        try:
            with storage_errors(
                self.root, "opening the artifact root", fs=self._fs, storage_options=self.storage_options
            ):
                self._fs.call_s3("head_bucket", Bucket=bucket)
        except StorageError:
            raise
        except FileNotFoundError:  # HEAD answers a bare 404, without the NoSuchBucket code
            raise StorageBucketNotFound(
                f"bucket {bucket!r} does not exist at {endpoint} (artifact root {self.root}); create it "
                f"(e.g. `aws s3 mb s3://{bucket}`) or fix store.root / AWS_ENDPOINT_URL",
                uri=self.root,
                endpoint=endpoint,
                bucket=bucket,
            ) from None

    def _producer_info(self) -> ProducerInfo:
        # Resolved once per store: it runs `git` and the answer cannot change within a process.
        if self._producer is None:
            self._producer = producer_info()
        return self._producer


def etag_of(info: Any) -> str | None:
    """The ETag in an S3 PutObject / HeadObject / fsspec info answer, if any."""
    if isinstance(info, dict):
        value = info.get("ETag") or info.get("etag")
        if value:
            return str(value).strip('"')
    return None
