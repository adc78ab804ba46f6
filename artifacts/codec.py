"""Samples <-> parquet bytes.

One row per sample, plain columns only (token ids as list columns, free-form values as JSON text),
so pandas/duckdb read the file without rollflow and nothing is ever unpickled (DESIGN.md section 2).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ArtifactSchemaError
from .sample import Sample, Status

CODEC_NAME = b"rollflow.samples/1"

SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("index", pa.int64(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_is_chat", pa.bool_(), nullable=False),
        pa.field("tokens", pa.list_(pa.int64()), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_length", pa.int64(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("rollout_log_probs", pa.list_(pa.float64()), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("reward_json", pa.string(), nullable=True),
        pa.field("label", pa.string(), nullable=True),
        pa.field("status", pa.string(), nullable=False),
        pa.field("weight_version", pa.int64(), nullable=False),
        pa.field("reward_key", pa.string(), nullable=True),
        pa.field("metadata", pa.string(), nullable=False),
    ],
    metadata={b"rollflow.codec": CODEC_NAME},
)

_JSON_TYPES_HINT = "use JSON types only (str, int, float, bool, None, list, dict with str keys)"


def _to_json(value: Any, *, column: str, where: str) -> str:
    try:
        # allow_nan (the default) keeps NaN/inf metrics lossless; the column is text either way.
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ArtifactSchemaError(
            f"{where}: {column} is not JSON-serializable ({exc}); {_JSON_TYPES_HINT}", field=column
        ) from None


def _where(sample: Sample, position: int) -> str:
    return f"samples[{position}] (group {sample.group_index}, index {sample.index})"


def _encode_reward(sample: Sample, where: str) -> tuple[float | None, str | None]:
    reward = sample.reward
    if reward is None:
        return None, None
    if isinstance(reward, dict):
        return None, _to_json(reward, column="reward", where=where)
    if isinstance(reward, (int, float)):
        return float(reward), None
    try:  # numpy / torch scalars
        return float(reward), None
    except (TypeError, ValueError):
        raise ArtifactSchemaError(
            f"{where}: reward must be a float, a dict or None, got {type(reward).__name__}", field="reward"
        ) from None


def samples_to_parquet_bytes(samples: Sequence[Sample]) -> bytes:
    """Encode samples as one parquet file. Raises ArtifactSchemaError naming a bad field."""
    columns: dict[str, list[Any]] = {field.name: [] for field in SAMPLES_SCHEMA}
    for position, sample in enumerate(samples):
        where = _where(sample, position)
        is_chat = not isinstance(sample.prompt, str)
        if is_chat and not isinstance(sample.prompt, list):
            raise ArtifactSchemaError(
                f"{where}: prompt must be a str or a list of chat messages, "
                f"got {type(sample.prompt).__name__}",
                field="prompt",
            )
        if sample.label is not None and not isinstance(sample.label, str):
            raise ArtifactSchemaError(
                f"{where}: label must be a str or None, got {type(sample.label).__name__}; "
                "convert it (e.g. str() or json.dumps) before storing",
                field="label",
            )
        reward, reward_json = _encode_reward(sample, where)
        columns["group_index"].append(sample.group_index)
        columns["index"].append(sample.index)
        prompt = _to_json(sample.prompt, column="prompt", where=where) if is_chat else sample.prompt
        columns["prompt"].append(prompt)
        columns["prompt_is_chat"].append(is_chat)
        columns["tokens"].append(sample.tokens)
        columns["response"].append(sample.response)
        columns["response_length"].append(sample.response_length)
        columns["loss_mask"].append(sample.loss_mask)
        columns["rollout_log_probs"].append(sample.rollout_log_probs)
        columns["reward"].append(reward)
        columns["reward_json"].append(reward_json)
        columns["label"].append(sample.label)
        columns["status"].append(Status.parse(sample.status).value)
        columns["weight_version"].append(sample.weight_version)
        columns["reward_key"].append(sample.reward_key)
        columns["metadata"].append(_to_json(sample.metadata, column="metadata", where=where))

    arrays = []
    for field in SAMPLES_SCHEMA:
        try:
            arrays.append(pa.array(columns[field.name], type=field.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise ArtifactSchemaError(
                f"column {field.name!r} cannot be stored as {field.type} ({exc})", field=field.name
            ) from None
    table = pa.Table.from_arrays(arrays, schema=SAMPLES_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _arrow_owned(data: bytes) -> pa.Buffer:
    """A copy of `data` in Arrow-allocated memory.

    Parquet reads run on Arrow's thread pools. Handed the Python `bytes` itself, a pool thread may drop
    the last reference to it after the read returned, and releasing a Python-owned buffer needs the
    GIL: at interpreter exit that thread cannot take it and the process aborts ("terminate called
    without an active exception", rc 134, about 1 run in 16 of `rollflow export-slime`). Arrow-owned
    memory is released without Python; pre-buffering (read-ahead tasks that outlive the call) is off too.
    """
    buf = pa.allocate_buffer(len(data))
    if len(data):
        memoryview(buf).cast("B")[:] = data
    return buf


def samples_table_from_parquet_bytes(data: bytes) -> pa.Table:
    """The samples payload as a pyarrow table with `SAMPLES_SCHEMA`'s columns and types (safe casts of
    other writers' types), for columnar readers; `samples_from_parquet_bytes` decodes it to `Sample`s."""
    try:
        table = pq.read_table(pa.BufferReader(_arrow_owned(data)), pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ArtifactSchemaError(
            f"samples payload is not a readable parquet file ({exc})", field="samples.parquet"
        ) from None
    for field in SAMPLES_SCHEMA:
        if field.name not in table.column_names:
            raise ArtifactSchemaError(
                f"samples parquet has no column {field.name!r} (columns: {table.column_names}); "
                "it was not written by rollflow's codec or is from an incompatible version",
                field=field.name,
            )
        column = table.column(field.name)
        if column.type != field.type:
            # Files written by other tools (duckdb, pandas) may widen/narrow types: accept safe casts.
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowException, TypeError, ValueError):
                raise ArtifactSchemaError(
                    f"column {field.name!r} has type {column.type}, expected {field.type}", field=field.name
                ) from None
            table = table.set_column(table.column_names.index(field.name), field.name, column)
        if not field.nullable and column.null_count:
            raise ArtifactSchemaError(f"column {field.name!r} contains nulls", field=field.name)
    return table


def _list_column(table: pa.Table, name: str) -> list[list[Any]]:
    """Split a list column into Python lists without per-element Arrow scalars (fast for big rollouts)."""
    array = table.column(name).combine_chunks()
    if array.values.null_count:
        raise ArtifactSchemaError(f"column {name!r} contains null elements", field=name)
    # `offsets` respects slicing and indexes into the unsliced `values`, so both pair up directly.
    offsets = array.offsets.to_pylist()
    flat = array.values.to_numpy(zero_copy_only=False).tolist()
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(array))]


def _from_json(text: str, *, column: str, row: int, expected: type) -> Any:
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ArtifactSchemaError(
            f"row {row}: column {column!r} holds invalid JSON ({exc})", field=column
        ) from None
    if not isinstance(value, expected):
        raise ArtifactSchemaError(
            f"row {row}: column {column!r} must hold a JSON {expected.__name__}, got {type(value).__name__}",
            field=column,
        )
    return value


def samples_from_parquet_bytes(data: bytes) -> list[Sample]:
    """Decode what samples_to_parquet_bytes wrote. Raises ArtifactSchemaError naming the column."""
    table = samples_table_from_parquet_bytes(data)
    plain = {
        name: table.column(name).to_pylist()
        for name in SAMPLES_SCHEMA.names
        if name not in ("tokens", "loss_mask", "rollout_log_probs")
    }
    tokens = _list_column(table, "tokens")
    loss_mask = _list_column(table, "loss_mask")
    log_probs = _list_column(table, "rollout_log_probs")

    samples: list[Sample] = []
    for row in range(table.num_rows):
        prompt: Any = plain["prompt"][row]
        if plain["prompt_is_chat"][row]:
            prompt = _from_json(prompt, column="prompt", row=row, expected=list)
        reward: Any = plain["reward"][row]
        reward_json = plain["reward_json"][row]
        if reward_json is not None:
            if reward is not None:
                raise ArtifactSchemaError(
                    f"row {row}: both 'reward' and 'reward_json' are set; exactly one may hold the reward",
                    field="reward",
                )
            reward = _from_json(reward_json, column="reward_json", row=row, expected=dict)
        try:
            status = Status.parse(plain["status"][row])
        except ValueError as exc:
            raise ArtifactSchemaError(f"row {row}: column 'status': {exc}", field="status") from None
        samples.append(
            Sample(
                group_index=plain["group_index"][row],
                index=plain["index"][row],
                prompt=prompt,
                tokens=tokens[row],
                response=plain["response"][row],
                response_length=plain["response_length"][row],
                loss_mask=loss_mask[row],
                rollout_log_probs=log_probs[row],
                reward=reward,
                label=plain["label"][row],
                status=status,
                weight_version=plain["weight_version"][row],
                reward_key=plain["reward_key"][row],
                metadata=_from_json(plain["metadata"][row], column="metadata", row=row, expected=dict),
            )
        )
    return samples

