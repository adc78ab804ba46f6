"""`RolloutStore`: the commit protocol and the verified reads over one root, plus the run's other files."""

from __future__ import annotations

import os
from typing import IO, Any

from ..errors import ArtifactError, ArtifactExists
from .artifact import RolloutArtifact
from .commit import CommitProtocol
from .reading import VerifiedReads
from .refs import ArtifactRef, protocol_of, validate_rel


class RolloutStore(CommitProtocol, VerifiedReads):
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

    def __repr__(self) -> str:
        return f"RolloutStore({self.root!r})"

    def load_uri(self, uri: str) -> RolloutArtifact:
        """Load from an artifact folder URI (ArtifactRef.uri), possibly under another root."""
        ref = ArtifactRef.from_uri(uri)
        if ref.root == self.root:
            return self.load(ref.run, ref.split, ref.rollout_id)
        # Credentials only make sense for the same kind of filesystem.
        options = self.storage_options if protocol_of(ref.root) == protocol_of(self.root) else None
        return RolloutStore(ref.root, options).load(ref.run, ref.split, ref.rollout_id)

    # -- generic run files (checkpoints index, metrics, reports): paths relative to the root

    def open(self, rel: str, mode: str = "rb") -> IO[Any]:
        path = self._path(validate_rel(rel))
        if self._local and any(flag in mode for flag in "wax"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return self._fs.open(path, mode)

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write (replace) a run file; atomic on local disks. Returns its URI."""
        self._put(self._path(validate_rel(rel)), data)
        return self.path_uri(rel)

    def create_bytes(self, rel: str, data: bytes) -> bool:
        """Commit a run file only if it does not exist yet: the rollouts' commit point, for other markers
        (checkpoints' meta.json). Atomic and no-clobber on local disks (hard link of a complete temp
        file), a conditional PUT (`If-None-Match: *`) on S3. Returns False if the file already existed."""
        path = self._path(validate_rel(rel))
        try:
            self._commit_manifest(path, data, uri=self.path_uri(rel))
        except ArtifactExists:
            return False
        return True

    def delete_path(self, rel: str) -> None:
        """Remove a run file if it exists (e.g. a commit marker being withdrawn before its payload is replaced)."""
        path = self._path(validate_rel(rel))
        with self._guard(path, "deleting"):
            try:
                self._fs.rm_file(path)
            except FileNotFoundError:
                pass
            self._fs.invalidate_cache(path)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self._cat(self._path(validate_rel(rel)))
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise FileNotFoundError(f"no file {rel!r} under root {self.root!r} ({self.path_uri(rel)})") from None

    def exists_path(self, rel: str) -> bool:
        return self._exists(self._path(validate_rel(rel)))
