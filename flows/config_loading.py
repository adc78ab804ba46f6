"""A RunConfig from the command line's pieces: an optional JSON file plus `key.sub=value` overrides, every problem
phrased for the user (ConfigError: field names and fixes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollflow.flows.config import RunConfig


class ConfigError(ValueError):
    """A config problem, already phrased for the user (field names and fixes)."""


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `rollflow config` prints every field)"
        lines.append(f"{where}: {msg}" if where else msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def parse_value(raw: str) -> Any:
    """CLI override values: JSON when it parses (numbers, bools, null), else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> RunConfig:
    """RunConfig from an optional JSON/YAML-less JSON file plus `key.sub=value` overrides."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data.update(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid JSON: {exc}") from exc
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-4")
        set_dotted(data, key.strip(), parse_value(raw))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
