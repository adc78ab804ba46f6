"""`RolloutArtifact`: a committed rollout's manifest and samples, held as columns."""

from __future__ import annotations

from ..columns import SampleColumns
from ..errors import ArtifactSchemaError
from ..manifest import Manifest
from ..sample import Sample
from .refs import SAMPLES_NAME, ArtifactRef, join_uri


class RolloutArtifact:
    """A manifest plus its samples, held as columns; `samples` materialises `Sample` objects on first use."""

    def __init__(
        self,
        manifest: Manifest,
        samples: list[Sample] | None = None,
        root: str | None = None,
        *,
        columns: SampleColumns | None = None,
    ) -> None:
        if (samples is None) == (columns is None):
            raise ValueError("RolloutArtifact takes either samples or columns")
        self.manifest = manifest
        # Set by RolloutStore.load; an artifact assembled in memory has no location yet.
        self.root = root
        self._samples = samples
        self._columns = columns

    def __repr__(self) -> str:
        return (
            f"RolloutArtifact({self.manifest.split} rollout {self.manifest.rollout_id} of run "
            f"{self.manifest.run!r}, {self.manifest.n_samples} samples, root={self.root!r})"
        )

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
