"""Rollout artifacts: the `Sample` data contract, its parquet codec and the fsspec store.

Importable without torch, Prefect, Ray or transformers (docs/architecture.md section 3). Names load lazily, so
`from rollflow.artifacts.sample import Sample` on a GPU box needs neither pyarrow nor fsspec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "columns_from_parquet": "codec",
    "columns_to_parquet": "codec",
    "samples_from_parquet_bytes": "codec",
    "samples_table_from_parquet_bytes": "codec",
    "samples_to_parquet_bytes": "codec",
    "ListColumn": "columns",
    "SampleColumns": "columns",
    "ArtifactCorrupt": "errors",
    "ArtifactError": "errors",
    "ArtifactExists": "errors",
    "ArtifactNotFound": "errors",
    "ArtifactSchemaError": "errors",
    "SCHEMA_VERSION": "manifest",
    "EngineInfo": "manifest",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    "ProducerInfo": "manifest",
    "producer_info": "manifest",
    "Sample": "sample",
    "Status": "sample",
    "ArtifactRef": "store",
    "RolloutArtifact": "store",
    "RolloutStore": "store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'artifacts' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
