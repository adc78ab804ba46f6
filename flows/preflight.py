"""Checks of a command's inputs that run before Prefect, Ray or any actor starts.

Each raises `PreflightError` with one line naming the setting and the fix; the CLI prints it and
exits with code 2. Nothing here writes to the store (a probe file in the root is created and
removed at once) and nothing loads a model.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable

from rollflow.artifacts.errors import format_ids
from rollflow.artifacts.slime import discover_template_ids
from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import RolloutStore, validate_run
from rollflow.flows.cluster_checks import check_cluster_store
from rollflow.flows.config import RunConfig
from rollflow.flows.input_errors import PreflightError
from rollflow.flows.tracking import mlflow_problem, mlflow_uri
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.rollout.dataset import detect_format

# ----------------------------------------------------------------------------- the store


def _local_path(root: str) -> str | None:
    if root.startswith("file://"):
        return root[len("file://") :]
    return None if "://" in root else root


def check_store_writable(root: str) -> None:
    """A local root must be (or be creatable as) a writable folder; remote roots get `check_access`."""
    path = _local_path(root)
    if path is None:
        RolloutStore(root).check_access()  # endpoint, credentials, bucket: one StorageError
        return
    path = os.path.abspath(os.path.expanduser(path))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise PreflightError(f"store.root={root!r}: {probe} is a file, not a folder; point store.root at a folder")
    # os.access is not the whole truth (read-only mounts, ACLs, root): create and remove a probe at once.
    try:
        if probe != path:  # the root does not exist yet: can its nearest existing parent hold folders?
            os.rmdir(tempfile.mkdtemp(prefix=".rollflow-write-probe-", dir=probe))
        else:
            fd, name = tempfile.mkstemp(prefix=".rollflow-write-probe-", dir=path)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        where = f"{probe} (its nearest existing folder)" if probe != path else path
        raise PreflightError(
            f"store.root={root!r} is not writable: {where}: {exc.strerror or exc}; choose a "
            "writable folder (--set store.root=...) or fix its permissions"
        ) from None


# ----------------------------------------------------------------------------- the model


def check_model(spec: str) -> None:
    """The model directory, its config.json, weights and tokenizer (or the built-in model's files)."""
    resolve_model_path(spec)  # ModelDirError / ValueError / FileNotFoundError name the missing file


def model_vocab_size(spec: str) -> int | None:
    """`vocab_size` of the model's config.json (None when it does not say)."""
    try:
        value = json.loads((resolve_model_path(spec) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


# ----------------------------------------------------------------------------- prompt datasets


def _required_keys(data: Any) -> list[tuple[str, str]]:
    keys = [(data.input_key, "data.input_key")]
    if data.label_key is not None:
        keys.append((data.label_key, "data.label_key"))
    keys += [(k, "data.metadata_keys") for k in data.metadata_keys]
    return keys


def _missing(where: str, key: str, setting: str, keys: Iterable[str]) -> PreflightError:
    hint = "; set data.label_key=null for data without labels" if setting == "data.label_key" else ""
    return PreflightError(f"{where} has no {key!r} ({setting}); its keys: {sorted(keys)}{hint}")


def scan_dataset(path: str, fmt: str, data: Any) -> int:
    """Stream `path` once and require the configured keys in every record; returns the record count.

    Parquet: the keys must be columns, and the prompt column must have no nulls (read column by
    column, batch by batch). JSONL: Arrow's streaming JSON reader (C++, block by block); a file whose
    value types vary between rows falls back to a line-by-line scan.
    """
    kind = detect_format(path, fmt)
    fs, fs_path = open_fs(path)
    if not fs.exists(fs_path):
        raise PreflightError(f"data.path={path!r}: no such file")
    required = _required_keys(data)
    if kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open(fs_path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
                raise PreflightError(f"data.path={path!r} is not a readable parquet file ({exc})") from None
            names = pf.schema_arrow.names
            for key, setting in required:
                if key not in names:
                    raise _missing(f"data.path={path!r} (every record)", key, setting, names)
            offset = 0
            for batch in pf.iter_batches(columns=[data.input_key], batch_size=65536):
                column = batch.column(0)
                if column.null_count:
                    row = offset + next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
                    raise PreflightError(
                        f"data record {row} of {path!r} has no value for {data.input_key!r} (data.input_key is null)"
                    )
                offset += batch.num_rows
            return pf.metadata.num_rows
    with fs.open(fs_path, "rb") as f:
        try:
            return _scan_jsonl_arrow(f, path, required)
        except _ArrowCannot:
            pass
    with fs.open(fs_path, "rb") as f:
        return _scan_jsonl_lines(f, path, required)


class _ArrowCannot(Exception):
    pass


def _scan_jsonl_arrow(f, path: str, required: list[tuple[str, str]]) -> int:
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        reader = pj.open_json(f, read_options=pj.ReadOptions(block_size=8 << 20))
        offset = 0
        for batch in reader:
            names = batch.schema.names
            for key, _setting in required:
                if key not in names:
                    raise _ArrowCannot()  # which record lacks it: the line scan names it
                if batch.column(key).null_count:
                    raise _ArrowCannot()  # missing (or null) in some record: let the line scan name it
            offset += batch.num_rows
    except pa.ArrowInvalid:
        raise _ArrowCannot() from None  # types vary between rows, or not JSON: the line scan says where
    if offset == 0:
        raise _ArrowCannot()
    return offset


def _scan_jsonl_lines(f, path: str, required: list[tuple[str, str]]) -> int:
    try:
        import orjson

        loads = orjson.loads
    except ImportError:  # pragma: no cover - orjson is optional
        import json

        loads = json.loads
    index = 0
    for number, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            row = loads(line)
        except ValueError as exc:
            raise PreflightError(
                f"data.path={path!r} line {number} is not JSON ({exc}); one JSON object per line (JSONL)"
            ) from None
        if not isinstance(row, dict):
            raise PreflightError(f"data.path={path!r} line {number} is a {type(row).__name__}, not a JSON object")
        for key, setting in required:
            if key not in row or (setting == "data.input_key" and row[key] is None):
                raise _missing(f"data record {index} (line {number}) of {path!r}", key, setting, row)
        index += 1
    if index == 0:
        raise PreflightError(f"data.path={path!r} has no records")
    return index


def check_data(cfg: RunConfig) -> None:
    data = cfg.data
    if data.task != "dataset":
        return
    scan_dataset(data.path, data.format, data)
    if data.eval is not None and data.eval.path and data.eval.path != data.path:
        scan_dataset(data.eval.path, data.eval.format, data)


# ----------------------------------------------------------------------------- runs and ids


def parse_ids(spec: str | None) -> list[int] | None:
    """'3', '0,2,5', '0-4' (inclusive) or a mix; None -> None."""
    if spec is None or not str(spec).strip():
        return None
    ids: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise PreflightError(f"--ids {spec!r}: {part!r} is not an id or a range like 0-4") from None
        if last < first:
            raise PreflightError(
                f"--ids {spec!r}: range {part!r} runs backwards (it would select no rollout); "
                f"write it low-high, e.g. {last}-{first}"
            )
        ids.extend(range(first, last + 1))
    if any(i < 0 for i in ids):
        raise PreflightError(f"--ids {spec!r}: rollout ids are >= 0")
    return sorted(set(ids))


def check_source_run(cfg: RunConfig, source_run: str, rollout_ids: list[int] | None) -> None:
    """`--source-run` names a run with committed train rollouts (and the pinned ids exist)."""
    try:
        validate_run(source_run)
    except ValueError as exc:
        raise PreflightError(f"--source-run {source_run!r}: {exc}") from None
    store = RolloutStore(cfg.store.root)
    have = store.list_ids(source_run, "train")
    if not have:
        runs = store.list_runs()
        raise PreflightError(
            f"--source-run {source_run!r} has no committed rollouts under {cfg.store.root}; runs "
            f"there: {', '.join(runs[:20]) or 'none'}"
        )
    if rollout_ids is not None:
        missing = sorted(set(rollout_ids) - set(have))
        if missing:
            raise PreflightError(
                f"--ids: run {source_run!r} has no rollout(s) {format_ids(missing)}; committed: {format_ids(have)}"
            )


def check_slime_template(template: str, rollout_ids: list[int] | None) -> None:
    found = discover_template_ids(template)
    if not found["train"]:
        raise PreflightError(
            f"--load-debug-rollout-data {template!r}: no dump matches (expected files like "
            f"{template.format(rollout_id=0)!r})"
        )
    if rollout_ids is not None:
        missing = sorted(set(rollout_ids) - set(found["train"]))
        if missing:
            raise PreflightError(
                f"--ids: no slime dump for rollout(s) {missing} of {template!r}; found {found['train']}"
            )


# ----------------------------------------------------------------------------- tracking


def check_tracking(cfg: RunConfig) -> None:
    """With `tracking.fatal`, an MLflow setup that cannot work (server unreachable, store refused) stops the
    command here; without it the flow reports it in one warning and runs untracked (flows/tracking.py)."""
    if not cfg.tracking.fatal or "mlflow" not in cfg.tracking.backends:
        return
    problem = mlflow_problem(mlflow_uri(cfg))
    if problem:
        raise PreflightError(
            f"tracking.uri={cfg.tracking.uri!r}: {problem}; fix tracking.uri, or set tracking.fatal=false to "
            "run without MLflow (one warning)"
        )


# ----------------------------------------------------------------------------- per command


def preflight(
    cfg: RunConfig, command: str, *, rollout_ids: list[int] | None = None, source_run: str | None = None
) -> None:
    """Everything a flow command can check before Prefect, Ray or an actor starts."""

    check_cluster_store(cfg)  # a local store.root on a multi-node Ray cluster (joins the cluster named by ray.address)
    check_store_writable(cfg.store.root)
    check_model(cfg.model.path)
    check_tracking(cfg)
    if command in ("train", "rollout", "align"):
        check_data(cfg)
    if command == "replay":
        if cfg.debug.load_debug_rollout_data:
            check_slime_template(cfg.debug.load_debug_rollout_data, rollout_ids)
        else:
            check_source_run(cfg, source_run or cfg.run, rollout_ids)
