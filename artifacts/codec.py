"""Sample columns <-> parquet, through pyarrow's native reader and writer.

One row per sample, plain columns only (token ids as list columns, free-form values as JSON text),
so pandas/duckdb read the file without rollflow and nothing is ever unpickled (docs/architecture.md section 5.3).
The per-token columns go between Arrow buffers and parquet pages in C++; Python touches rows only
for the small JSON fields, and only when `Sample` objects are asked for.

Payload formats (recorded in the manifest's file entry and in the parquet key-value metadata):
- 1 (`rollflow.samples/1`): token ids int64; written row by row from `Sample` lists.
- 2 (`rollflow.samples/2`): token ids int32, written from Arrow columns; no dictionary pages or
  statistics on the per-token columns (random-access ids gain nothing from them and they cost most
  of the encode time). Both read into the same columns: readers cast format 1's int64 ids safely.

Compression is per column and not part of the format (parquet records it per page, every reader
decodes all of these). Since issue 37: token ids uncompressed (random-looking ids: zstd cost 16 ms per
4M ids to save a third); log-probs byte-stream-split + lz4 (engines' float32 values stored as float64
leave four zero bytes in each value, which the split lines up: 47% smaller for +12 ms per 3M values,
where zstd cost +75 ms for 40%); everything else zstd (loss masks, runs of 0 / 1, and the scalar
columns compress to almost nothing and cost little). Leaving the log-probs uncompressed too would
have cost a 67M-token load 2.14x its columns in memory (the payload is held while it is decoded).
Files written with zstd everywhere read the same.

Also since issue 37 the per-token values are written as required (never null) parquet fields
(`STORAGE_SCHEMA`): a reader then rebuilds each list from its repetition levels alone, which halved
the decode. The columns read back as `SAMPLES_SCHEMA`'s (a metadata-only cast), also in readers
from before (their safe cast of format 1's ids does it), so the format stays 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .columns import OPTIONAL, PER_TOKEN, SAMPLES_SCHEMA, SampleColumns
from .errors import ArtifactSchemaError
from .sample import Sample, Status

PAYLOAD_FORMAT = "rollflow.samples/2"
READABLE_FORMATS = frozenset({"rollflow.samples/1", PAYLOAD_FORMAT})
CODEC_NAME = PAYLOAD_FORMAT.encode()
_SCALARS = [f.name for f in SAMPLES_SCHEMA if f.name not in PER_TOKEN and f.name not in OPTIONAL]
CODECS = {"tokens": "none", "rollout_log_probs": "lz4"}


def _leaf(name: str) -> str:
    # parquet names a list column's values "<name>.list.element" (pyarrow's compliant nested layout)
    return f"{name}.list.element" if name in PER_TOKEN else name


COMPRESSION = {_leaf(f.name): CODECS.get(f.name, "zstd") for f in SAMPLES_SCHEMA if f.name not in OPTIONAL}
COMPRESSION["routed_experts.list.element.list.element.list.element"] = "zstd"
BYTE_STREAM_SPLIT = [_leaf("rollout_log_probs")]


def _required_values(field: pa.Field) -> pa.Field:
    if field.name not in PER_TOKEN:
        return field
    return field.with_type(pa.list_(pa.field("element", field.type.value_type, nullable=False)))


STORAGE_SCHEMA = pa.schema([_required_values(f) for f in SAMPLES_SCHEMA])

__all__ = [
    "CODEC_NAME",
    "PAYLOAD_FORMAT",
    "READABLE_FORMATS",
    "SAMPLES_SCHEMA",
    "SampleColumns",
    "columns_from_parquet",
    "columns_to_parquet",
    "samples_from_parquet_bytes",
    "samples_table_from_parquet_bytes",
    "samples_to_parquet_bytes",
]


# Row groups of about this many bytes of columns: a reader decodes one group at a time, so its transient
# memory (Arrow's list decoders peak near 3x what they decode) stays a few groups, not 3x the rollout.
ROW_GROUP_BYTES = 16 << 20


def columns_to_parquet(columns: SampleColumns) -> pa.Buffer:
    """Encode columns as one parquet file in Arrow memory (no Python `bytes` copy)."""
    for name in PER_TOKEN:
        # Columns are checked before they get here (`first_invalid`); a null value would otherwise
        # reach a required parquet field.
        if pc.list_flatten(columns.table.column(name)).null_count:
            raise ArtifactSchemaError(f"column {name!r} contains null elements", field=name)
    sink = pa.BufferOutputStream()
    table = columns.table.cast(STORAGE_SCHEMA).replace_schema_metadata({b"rollflow.codec": CODEC_NAME})
    rows = max(1, int(ROW_GROUP_BYTES * len(columns) / max(1, columns.nbytes)))
    pq.write_table(
        table,
        sink,
        compression=COMPRESSION,
        use_byte_stream_split=BYTE_STREAM_SPLIT,
        use_dictionary=_SCALARS,
        write_statistics=_SCALARS,
        row_group_size=rows,
        use_compliant_nested_type=True,
    )
    return sink.getvalue()


def samples_to_parquet_bytes(samples: Sequence[Sample]) -> bytes:
    """Encode samples as one parquet file. Raises ArtifactSchemaError naming a bad field."""
    return columns_to_parquet(SampleColumns.from_samples(samples)).to_pybytes()


def arrow_owned(data: bytes | memoryview) -> pa.Buffer:
    """A copy of `data` in Arrow-allocated memory.

    Parquet reads run on Arrow's thread pools. Handed the Python `bytes` itself, a pool thread may drop
    the last reference to it after the read returned, and releasing a Python-owned buffer needs the
    GIL: at interpreter exit that thread cannot take it and the process aborts ("terminate called
    without an active exception", rc 134, about 1 run in 16 of `rollflow export-slime`). Arrow-owned
    memory is released without Python; pre-buffering (read-ahead tasks that outlive the call) is off too.
    The system allocator (not Arrow's default pool, which keeps freed pages for reuse): a payload is one
    large block, mapped and unmapped whole, so its memory is back with the OS as soon as it is decoded.
    """
    buf = pa.allocate_buffer(len(data), memory_pool=pa.system_memory_pool())
    if len(data):
        memoryview(buf).cast("B")[:] = data
    return buf


_arrow_owned = arrow_owned  # the name display.py and tests know


def _read_table(data: bytes | pa.Buffer) -> pa.Table:
    buf = data if isinstance(data, pa.Buffer) else arrow_owned(data)
    try:
        return pq.read_table(pa.BufferReader(buf), pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ArtifactSchemaError(
            f"samples payload is not a readable parquet file ({exc})", field="samples.parquet"
        ) from None


def _conform(table: pa.Table) -> pa.Table:
    """`SAMPLES_SCHEMA`'s columns and types (safe casts of format 1 and of other writers' types)."""
    arrays = []
    for field in SAMPLES_SCHEMA:
        if field.name in OPTIONAL and field.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        if field.name not in table.column_names:
            raise ArtifactSchemaError(
                f"samples parquet has no column {field.name!r} (columns: {table.column_names}); "
                "it was not written by rollflow's codec or is from an incompatible version",
                field=field.name,
            )
        column = table.column(field.name)
        if column.type != field.type:
            # Format 1 (int64 ids) and files written by other tools (duckdb, pandas) differ in widths.
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowException, TypeError, ValueError):
                raise ArtifactSchemaError(
                    f"column {field.name!r} has type {column.type}, expected {field.type}", field=field.name
                ) from None
        if not field.nullable and column.null_count:
            raise ArtifactSchemaError(f"column {field.name!r} contains nulls", field=field.name)
        if field.name in PER_TOKEN and pc.list_flatten(column).null_count:
            raise ArtifactSchemaError(f"column {field.name!r} contains null elements", field=field.name)
        arrays.append(column)
    table = pa.Table.from_arrays(arrays, schema=SAMPLES_SCHEMA)
    return _canonical_status(table)


def _canonical_status(table: pa.Table) -> pa.Table:
    """Status spelled as our values; other writers' spellings ("COMPLETED", "Status.TRUNCATED") are
    parsed once per distinct value; an unknown one is an error naming its first row."""
    column = table.column("status")
    allowed = pa.array([s.value for s in Status])
    if pc.all(pc.is_in(column, value_set=allowed)).as_py() is not False:
        return table
    mapping = {}
    for row, value in enumerate(column.to_pylist()):
        if value not in mapping:
            try:
                mapping[value] = Status.parse(value).value
            except ValueError as exc:
                raise ArtifactSchemaError(f"row {row}: column 'status': {exc}", field="status") from None
    fixed = pa.array([mapping[v] for v in column.to_pylist()], pa.string())
    return table.set_column(table.column_names.index("status"), SAMPLES_SCHEMA.field("status"), fixed)


def columns_from_parquet(data: bytes | pa.Buffer) -> SampleColumns:
    """Decode a samples payload (format 1 or 2) into columns. Raises ArtifactSchemaError naming the column."""
    table = _conform(_read_table(data))
    both = pc.and_(table.column("reward").is_valid(), table.column("reward_json").is_valid())
    if pc.any(both).as_py():
        row = int(pc.index(both, True).as_py())
        raise ArtifactSchemaError(
            f"row {row}: both 'reward' and 'reward_json' are set; exactly one may hold the reward", field="reward"
        )
    return SampleColumns(table)


def samples_table_from_parquet_bytes(data: bytes | pa.Buffer) -> pa.Table:
    """The samples payload as a pyarrow table with `SAMPLES_SCHEMA`'s columns and types, for columnar
    readers; `samples_from_parquet_bytes` decodes it to `Sample`s."""
    return columns_from_parquet(data).table


def samples_from_parquet_bytes(data: bytes | pa.Buffer) -> list[Sample]:
    """Decode a samples payload into `Sample`s. Raises ArtifactSchemaError naming the column."""
    return columns_from_parquet(data).to_samples()
