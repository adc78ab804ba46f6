"""The rollout artifact store: fsspec-backed, write-once, checksum-verified.

Layout (docs/architecture.md sections 5.3 and 5.4)::

    {root}/{run}/rollouts/{split}/{rollout_id:06d}/manifest.json
                                                  /samples.parquet

Commit protocol: the payload is written first and the manifest last; only a manifest makes an
artifact exist, so a crash mid-write leaves an invisible, overwritable folder. Committed artifacts
are immutable and every load verifies the digest + size of every payload file before parsing.

Samples travel as Arrow columns (columns.py): a write encodes them with pyarrow's parquet writer and
hashes the encoded bytes once; a load reads the file into Arrow memory, hashing each chunk as it
arrives, and decodes the columns natively. `Sample` objects are built only when asked for
(`RolloutArtifact.samples`).

One job per module: `refs` (names, URIs, `ArtifactRef`), `artifact` (`RolloutArtifact`), `localfs` (local-disk
primitives), `base` (the root and its guarded IO), `commit` (the commit protocol), `reading` (verified reads and
listing), `rollout_store` (`RolloutStore`, which joins them). Import the public names from here.
"""

from .artifact import RolloutArtifact
from .refs import (
    MANIFEST_NAME,
    SAMPLES_NAME,
    SPLITS,
    ArtifactRef,
    join_uri,
    normalize_root,
    validate_rollout_id,
    validate_run,
    validate_split,
)
from .rollout_store import RolloutStore

__all__ = [
    "MANIFEST_NAME",
    "SAMPLES_NAME",
    "SPLITS",
    "ArtifactRef",
    "RolloutArtifact",
    "RolloutStore",
    "join_uri",
    "normalize_root",
    "validate_rollout_id",
    "validate_run",
    "validate_split",
]
