"""Prompt datasets: JSONL or parquet files, local or on any fsspec URL, read in deterministic epochs.

The position of every sample is a pure function of the rollout id, so there is no hidden iterator
state that a resume could lose or replay twice:

    position p of rollout r, prompt j:  p = r * prompts_per_rollout + j
    epoch = p // n_records,  offset = p % n_records
    record = order(epoch)[offset]        order(e): a permutation seeded by (data.seed, e) (or 0..n-1)

Each epoch visits every record exactly once, in a fresh order; a rollout may straddle two epochs.
The cursor (epoch, offset, shuffle seed, samples consumed, and the dataset's size and sha256) after
each iteration is written into the checkpoint's meta.json; a resume recomputes it from the config
and refuses to continue when the two differ (a changed dataset, batch size, seed or shuffle would
otherwise silently continue at another sample: the reference framework's epoch-boundary bug).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import posixpath
import random
from typing import Any

from rollflow.artifacts.storage import open_fs
from rollflow.tasks.rollout.prompts import PromptItem

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataExhausted(RuntimeError):
    """The configured epochs are used up."""


class DataResumeMismatch(RuntimeError):
    """The checkpoint's data cursor differs from the one this config computes."""


@dataclasses.dataclass(frozen=True)
class Records:
    rows: tuple[dict[str, Any], ...]
    sha256: str
    source: str

    def __len__(self) -> int:
        return len(self.rows)


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    name = posixpath.basename(path.split("?", 1)[0]).lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise ValueError(
        f"data.path={path!r}: cannot tell the format from the name; use a .jsonl or .parquet file "
        "or set data.format='jsonl' / 'parquet'"
    )


def parse_records(data: bytes, fmt: str, source: str) -> list[dict[str, Any]]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise ValueError(f"data.path={source!r} is not a readable parquet file ({exc})") from None
    rows = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"data.path={source!r} line {number} is not JSON ({exc.msg}); one JSON object per line (JSONL)"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"data.path={source!r} line {number} is a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return rows


def load_records(path: str, fmt: str = "auto") -> Records:
    """All records of a JSONL / parquet file (local path or fsspec URL).

    Cached per process on (path, size, modification stamp): a file changed under a long-lived
    process is read again (and its new sha256 then stops a resume that expected the old one).
    """
    fs, fs_path = open_fs(path)
    try:
        fs.invalidate_cache(fs_path)
        info = fs.info(fs_path)
    except FileNotFoundError:
        raise FileNotFoundError(f"data.path={path!r}: no such file") from None
    stamp = [info.get(k) for k in ("size", "mtime", "LastModified", "ETag", "created")]
    return _read_records(path, fmt, repr(stamp))


@functools.lru_cache(maxsize=16)
def _read_records(path: str, fmt: str, stamp: str) -> Records:
    kind = detect_format(path, fmt)
    fs, fs_path = open_fs(path)
    with fs.open(fs_path, "rb") as f:
        data = f.read()
    rows = parse_records(data, kind, path)
    if not rows:
        raise ValueError(f"data.path={path!r} has no records")
    return Records(rows=tuple(rows), sha256=hashlib.sha256(data).hexdigest(), source=path)


load_records.cache_clear = _read_records.cache_clear  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    """The record order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def _label_text(value: Any) -> str | None:
    """Labels are text in artifacts: numbers as written (42, 2.5), other JSON values as JSON."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def record_to_item(
    row: dict[str, Any], data: Any, *, index: int, source: str, extra: dict[str, Any] | None = None
) -> PromptItem:
    """One record -> a PromptItem: chat messages (apply_chat_template) or text, label, metadata."""
    where = f"data record {index} of {source!r}"
    if data.input_key not in row:
        raise KeyError(f"{where} has no {data.input_key!r} (data.input_key); its keys: {sorted(row)}")
    value = row[data.input_key]
    if data.apply_chat_template:
        if isinstance(value, list):
            messages = [dict(m) for m in value]
        else:
            messages = [{"role": "user", "content": str(value)}]
        if data.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        prompt: Any = messages
    else:
        if isinstance(value, list):
            raise ValueError(f"{where}: {data.input_key!r} holds chat messages; set data.apply_chat_template=true")
        prompt = f"{data.system_prompt}\n\n{value}" if data.system_prompt else str(value)
    label = None
    if data.label_key is not None:
        if data.label_key not in row:
            raise KeyError(
                f"{where} has no {data.label_key!r} (data.label_key); its keys: {sorted(row)}; set "
                "data.label_key=null for data without labels"
            )
        label = _label_text(row[data.label_key])
    metadata: dict[str, Any] = {}
    for key in data.metadata_keys:
        if key not in row:
            raise KeyError(f"{where} has no {key!r} (data.metadata_keys); its keys: {sorted(row)}")
        metadata[key] = row[key]
    metadata.update(extra or {})
    return PromptItem(prompt=prompt, label=label, metadata=metadata)


def train_items(data: Any, rollout_id: int) -> list[PromptItem]:
    """The prompts of train rollout `rollout_id` (see the module docstring for the arithmetic)."""
    records = load_records(data.path, data.format)
    n, batch = len(records), data.prompts_per_rollout
    start = rollout_id * batch
    end = start + batch
    if data.epochs is not None and end > data.epochs * n:
        raise DataExhausted(
            f"rollout {rollout_id} needs samples {start}..{end - 1} but data.epochs={data.epochs} x {n} records "
            f"of {data.path!r} hold {data.epochs * n}; raise data.epochs (or leave it unset for no limit) or lower "
            "iterations"
        )
    items = []
    for position in range(start, end):
        epoch, offset = divmod(position, n)
        index = epoch_order(n, data.seed, epoch, data.shuffle)[offset]
        items.append(
            record_to_item(
                records.rows[index],
                data,
                index=index,
                source=data.path,
                extra={"data_index": index, "data_epoch": epoch},
            )
        )
    return items


def eval_items(data: Any) -> list[PromptItem]:
    """Every record of the eval set (or the first `eval.max_prompts`), in file order."""
    ev = data.eval
    path = ev.path or data.path
    records = load_records(path, ev.format)
    rows = records.rows[: ev.max_prompts] if ev.max_prompts else records.rows
    return [record_to_item(row, data, index=i, source=path, extra={"data_index": i}) for i, row in enumerate(rows)]


def data_state(data: Any, rollout_id: int) -> dict[str, Any]:
    """The data source's cursor before train rollout `rollout_id` (= after `rollout_id` iterations)."""
    if getattr(data, "task", "addition") != "dataset":
        # The built-in task draws rollout r's prompts from seed + r: the id is the whole cursor.
        return {
            "task": data.task,
            "seed": data.seed,
            "next_rollout_id": rollout_id,
            "prompts_per_rollout": data.prompts_per_rollout,
        }
    records = load_records(data.path, data.format)
    position = rollout_id * data.prompts_per_rollout
    epoch, offset = divmod(position, len(records))
    return {
        "task": "dataset",
        "path": data.path,
        "n_records": len(records),
        "sha256": records.sha256,
        "shuffle": data.shuffle,
        "shuffle_seed": data.seed,
        "prompts_per_rollout": data.prompts_per_rollout,
        "next_rollout_id": rollout_id,
        "samples_consumed": position,
        "epoch": epoch,
        "offset": offset,
    }


CURSOR_KEYS = ("task", "n_records", "sha256", "shuffle", "shuffle_seed", "samples_consumed", "epoch", "offset")


def check_resume(saved: dict[str, Any] | None, current: dict[str, Any], iteration: int) -> None:
    """Raise `DataResumeMismatch` when the checkpoint's cursor is not where this config resumes."""
    if not saved:
        return  # a checkpoint from before cursors were saved: nothing to compare
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}"
        for key in CURSOR_KEYS
        if saved.get(key) != current.get(key)
    ]
    if diffs:
        raise DataResumeMismatch(
            f"resuming after checkpoint {iteration} would not continue at the same sample: "
            + "; ".join(diffs)
            + ". Restore the data settings and file of the run (data.path, data.prompts_per_rollout, data.seed, "
            "data.shuffle), or start a new run (another run name)"
        )
