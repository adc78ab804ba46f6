"""Rollout artifacts: the `Sample` data contract, its parquet codec and the fsspec store.

Importable without torch, Prefect, Ray or transformers (DESIGN.md section 1).
"""

from .codec import samples_from_parquet_bytes, samples_to_parquet_bytes
from .errors import ArtifactCorrupt, ArtifactError, ArtifactExists, ArtifactNotFound, ArtifactSchemaError
from .manifest import SCHEMA_VERSION, EngineInfo, FileEntry, Manifest, ProducerInfo, producer_info
from .sample import Sample, Status
from .store import ArtifactRef, RolloutArtifact, RolloutStore

__all__ = [
    "SCHEMA_VERSION",
    "ArtifactCorrupt",
    "ArtifactError",
    "ArtifactExists",
    "ArtifactNotFound",
    "ArtifactRef",
    "ArtifactSchemaError",
    "EngineInfo",
    "FileEntry",
    "Manifest",
    "ProducerInfo",
    "RolloutArtifact",
    "RolloutStore",
    "Sample",
    "Status",
    "producer_info",
    "samples_from_parquet_bytes",
    "samples_to_parquet_bytes",
]
