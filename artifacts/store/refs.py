"""Where a rollout artifact lives: the layout's names, run/split/id validation, URIs, and `ArtifactRef`."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

MANIFEST_NAME = "manifest.json"
SAMPLES_NAME = "samples.parquet"
SPLITS = ("train", "eval")

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
        raise ValueError(f"root={root!r}: expected a non-empty path or fsspec URL (file://, s3://, memory://)")
    if "://" in root:
        protocol, rest = root.split("://", 1)
        return f"{protocol}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(root))


def join_uri(root: str, *parts: str) -> str:
    base = root if root.endswith("/") else root + "/"
    return base + "/".join(parts)


def protocol_of(root: str) -> str:
    return root.split("://", 1)[0] if "://" in root else "file"


def rollout_parts(run: str, split: str, rollout_id: int) -> tuple[str, ...]:
    return (run, "rollouts", split, f"{rollout_id:06d}")


def is_valid_run(name: str) -> bool:
    try:
        validate_run(name)
    except ValueError:
        return False
    return True


def validate_rel(rel: Any) -> str:
    if not isinstance(rel, str) or not rel:
        raise ValueError(f"path={rel!r}: expected a non-empty path relative to the store root")
    parts = rel.split("/")
    if rel.startswith("/") or "://" in rel or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"path={rel!r}: expected a relative path like '<run>/metrics.json' (no leading '/', "
            "no empty, '.' or '..' components, no URL scheme)"
        )
    return rel


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
        return join_uri(self.root, *rollout_parts(self.run, self.split, self.rollout_id))

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
            raise ValueError(f"uri={uri!r}: last component {id_text!r} is not a rollout id; expected {layout}")
        root = text[: len(text) - len("/".join(parts[-4:]))]
        return cls(root=root, run=run, split=split, rollout_id=int(id_text))
