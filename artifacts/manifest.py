"""The manifest: the small JSON document whose presence commits a rollout artifact.

It records what was produced (run, split, rollout id, sample counts), by what (rollflow version and
git sha, engine backend/model/weight version, config hash) and the integrity digest + size of every
payload file, so a load can prove it reads exactly what was written (docs/architecture.md section 5.2).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import re
import subprocess
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from .digests import HEX_LENGTHS, SHA256, XXH3_128, is_hex_digest
from .errors import ArtifactSchemaError

# 1: payload files without a format (samples.parquet in payload format rollflow.samples/1).
# 2: every file entry names its payload format (codec.py lists them); readers of 2 read 1 as well.
# 3: file entries record an xxh3-128 digest instead of sha256 (digests.py says why); readers verify either.
SCHEMA_VERSION = 3
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2, 3})
# What a file entry without `format` (schema_version 1) holds.
LEGACY_FORMATS = {"samples.parquet": "rollflow.samples/1"}
# The one digest field each schema version's entries carry.
DIGEST_FIELD = {1: SHA256, 2: SHA256, 3: XXH3_128}
# Counts, ids and sizes are int64 in Arrow, numpy and torch: a larger value is damage, not data.
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Exactly one digest: sha256 up to schema_version 2, xxh3_128 from 3 on (DIGEST_FIELD).
    sha256: str | None = None
    xxh3_128: str | None = None
    size: Count
    # The payload's format version (e.g. "rollflow.samples/2"); None in schema_version 1 manifests.
    format: str | None = None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        # The name is joined onto the artifact folder on load: a separator or ".." would let a
        # tampered manifest point the checksum check at some other file.
        if not value or "/" in value or "\\" in value or value in (".", ".."):
            raise ValueError(f"file name {value!r} must be a plain file name inside the artifact folder")
        return value

    @field_validator("sha256", "xxh3_128")
    @classmethod
    def _hex_digest(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not is_hex_digest(value, info.field_name):
            raise ValueError(f"{info.field_name} {value!r} is not {HEX_LENGTHS[info.field_name]} lowercase hex digits")
        return value

    @model_validator(mode="after")
    def _one_digest(self) -> "FileEntry":
        if (self.sha256 is None) == (self.xxh3_128 is None):
            raise ValueError(f"file {self.name!r} must record exactly one digest, sha256 or xxh3_128")
        return self

    @model_serializer(mode="wrap")
    def _only_its_digest(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The digest the entry does not use is left out, as its schema version's writer wrote it.
        data = handler(self)
        for key in (SHA256, XXH3_128):
            if data.get(key, "") is None:
                del data[key]
        return data

    @property
    def integrity(self) -> tuple[str, str]:
        """(algorithm, hex digest) that a load verifies."""
        return (XXH3_128, self.xxh3_128) if self.xxh3_128 is not None else (SHA256, self.sha256 or "")

    @property
    def content_digest(self) -> str:
        """The file's content identity for cache keys: the bare sha256 hex as before schema 3 (so keys of old
        artifacts stay what they were), "xxh3_128:<hex>" from schema 3 on."""
        algorithm, digest = self.integrity
        return digest if algorithm == SHA256 else f"{algorithm}:{digest}"


class ProducerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "rollflow"
    version: str
    git_sha: str | None = None


class EngineInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str
    model: str
    weight_version: Count


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    run: str
    rollout_id: Count
    split: Literal["train", "eval"]
    n_samples: Count
    n_samples_per_prompt: int = Field(ge=1, le=2**63 - 1)
    created_at: str = Field(default_factory=utc_now_iso)
    producer: ProducerInfo
    engine: EngineInfo
    config_hash: str = Field(min_length=1)
    files: list[FileEntry]
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(_unsupported_version_message(value))
        return value

    @field_validator("created_at")
    @classmethod
    def _utc_iso(cls, value: str) -> str:
        try:
            parsed = _dt.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"created_at {value!r} is not an ISO-8601 timestamp") from None
        if parsed.utcoffset() != _dt.timedelta(0):
            raise ValueError(f"created_at {value!r} must be in UTC (e.g. '2025-01-01T00:00:00+00:00')")
        return value

    @field_validator("files")
    @classmethod
    def _unique_names(cls, value: list[FileEntry]) -> list[FileEntry]:
        names = [entry.name for entry in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"files lists {dupes} more than once")
        return value

    @model_validator(mode="after")
    def _formats_named(self) -> "Manifest":
        # From schema 2 on every entry names its format; a missing one would be read as format 1.
        if self.schema_version >= 2:
            unnamed = [e.name for e in self.files if e.format is None]
            if unnamed:
                raise ValueError(f"files {unnamed} name no payload format (schema_version {self.schema_version})")
        # An entry verified with another schema's hash than its version's would mean a hand-edited manifest.
        digest = DIGEST_FIELD[self.schema_version]
        other = [e.name for e in self.files if getattr(e, digest) is None]
        if other:
            raise ValueError(
                f"files {other} record no {digest} (schema_version {self.schema_version} records {digest})"
            )
        return self

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ArtifactSchemaError(
            f"manifest of {self.split} rollout {self.rollout_id} (run {self.run!r}) lists no file "
            f"{name!r}; it lists {[e.name for e in self.files]}",
            field="files",
        )

    def file_format(self, name: str) -> str | None:
        """The format of payload file `name`: its entry's, or what schema_version 1 implied."""
        return self.file(name).format or LEGACY_FORMATS.get(name)

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode("utf-8") + b"\n"

    @classmethod
    def from_json_bytes(cls, data: bytes, *, uri: str | None = None) -> "Manifest":
        """Parse a manifest; every failure is an ArtifactSchemaError naming the field."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactSchemaError(f"manifest is not valid JSON ({exc})", field="manifest", uri=uri) from None
        if not isinstance(raw, dict):
            raise ArtifactSchemaError("manifest must be a JSON object", field="manifest", uri=uri)
        # Check the version first: a newer writer's manifest would otherwise be reported as a
        # list of unknown fields, hiding the real cause (and fix: upgrade rollflow).
        if "schema_version" not in raw:
            raise ArtifactSchemaError("manifest has no schema_version", field="schema_version", uri=uri)
        version = raw["schema_version"]
        if type(version) is not int:  # bool is an int, and a list or dict is not hashable
            raise ArtifactSchemaError(
                f"schema_version {version!r} is a {type(version).__name__}, not an integer",
                field="schema_version",
                uri=uri,
            )
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise ArtifactSchemaError(_unsupported_version_message(version), field="schema_version", uri=uri)
        missing = _missing_fields(raw, version)
        if missing:
            raise ArtifactSchemaError(
                f"manifest lacks {', '.join(missing)} (every writer writes every field)", field=missing[0], uri=uri
            )
        try:
            # strict: JSON types as written (no "3" for 3, no true for 1), so what loads is what is on disk
            return cls.model_validate(raw, strict=True)
        except ValidationError as exc:
            raise schema_error_from_validation(exc, uri=uri) from None


def _missing_fields(raw: dict, version: int) -> list[str]:
    """Fields a writer of `version` always wrote but `raw` lacks: a default filled in on load would hide the
    damage (a dropped `format` would read a format-2 payload as format 1). Values of the wrong type are left to
    validation, which names them."""
    missing = [k for k in Manifest.model_fields if k not in raw]
    for key, model in (("producer", ProducerInfo), ("engine", EngineInfo)):
        if isinstance(raw.get(key), dict):
            missing += [f"{key}.{k}" for k in model.model_fields if k not in raw[key]]
    digest = DIGEST_FIELD[version]
    entry_fields = [
        k
        for k in FileEntry.model_fields
        if (version >= 2 or k != "format") and (k == digest or k not in DIGEST_FIELD.values())
    ]
    files = raw.get("files")
    for i, entry in enumerate(files if isinstance(files, list) else []):
        if isinstance(entry, dict):
            missing += [f"files.{i}.{k}" for k in entry_fields if k not in entry]
    return missing


def _unsupported_version_message(value: Any) -> str:
    supported = ", ".join(str(v) for v in sorted(SUPPORTED_SCHEMA_VERSIONS))
    return (
        f"schema_version {value!r} is not supported by this rollflow (it reads {supported}); "
        "upgrade rollflow to read artifacts written by a newer version"
    )


def schema_error_from_validation(exc: ValidationError, *, uri: str | None = None) -> ArtifactSchemaError:
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "manifest"
    details = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'manifest'}: {err['msg']}" for err in exc.errors())
    return ArtifactSchemaError(f"invalid manifest field {field!r}: {details}", field=field, uri=uri)


def _git_sha(source_dir: Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=source_dir,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.split()
    if proc.returncode != 0 or len(lines) != 2:
        return None
    toplevel, sha = lines
    # An installed copy inside some other repository (a venv in a user's project) would otherwise
    # report that repository's commit: only trust a checkout whose top level holds this package.
    try:
        if Path(toplevel).resolve() != source_dir.resolve().parent:
            return None
    except OSError:
        return None
    return sha if re.fullmatch(r"[0-9a-f]{40,64}", sha) else None


def producer_info() -> ProducerInfo:
    """Describe this rollflow build. Never raises: provenance is best effort."""
    try:
        version = importlib.metadata.version("rollflow")
    except Exception:  # PackageNotFoundError, or broken metadata in odd installs
        version = "0.0.0+unknown"
    try:
        sha = _git_sha(Path(__file__).resolve().parent)
    except Exception:
        sha = None
    return ProducerInfo(version=version, git_sha=sha)
