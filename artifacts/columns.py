"""A rollout's samples as Arrow columns: the in-memory form of an artifact, end to end.

Per-token data (tokens, loss masks, rollout log-probs) lives in flat value buffers + offsets
(Arrow `list<...>` arrays), so storing, loading and batching a rollout never builds a Python
object per token. `Sample` objects exist only where a caller asks for them (`sample`, `to_samples`).

The schema is the parquet payload's (codec.py writes and reads this table as is), so the columns a
user sees in pandas/duckdb are exactly these.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ArtifactSchemaError
from .sample import Sample, Status, reward_value

# Payload format 2: token ids int32 (format 1 wrote int64; readers cast 1 -> 2 safely, and an old
# reader casts 2 -> 1 the same way). Token ids are vocabulary indices, far below 2**31.
SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("index", pa.int64(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_is_chat", pa.bool_(), nullable=False),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
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
        # Optional (MoE routing replay): expert ids [tokens - 1][layers][top-k], int16; null when not
        # recorded. Readers fill it with nulls in payloads written without it (same payload format).
        pa.field("routed_experts", pa.list_(pa.list_(pa.list_(pa.int16()))), nullable=True),
    ],
)
PER_TOKEN = ("tokens", "loss_mask", "rollout_log_probs")
# Columns a payload may lack (older writers): read back as nulls.
OPTIONAL = ("routed_experts",)
_STATUS_VALUES = pa.array([s.value for s in Status])
_JSON_TYPES_HINT = "use JSON types only (str, int, float, bool, None, list, dict with str keys)"


@dataclasses.dataclass(frozen=True)
class ListColumn:
    """One per-token column: row i is `values[offsets[i]:offsets[i + 1]]` (offsets start at 0)."""

    offsets: np.ndarray  # int64 [n + 1]
    values: np.ndarray  # flat, read-only view of the Arrow buffer (no copy)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


class SampleColumns:
    """The samples of one rollout as one Arrow table with `SAMPLES_SCHEMA`.

    A loaded table has one chunk per parquet row group and is never combined as a whole (that would
    copy the rollout once more): consumers that scan everything (`first_invalid`, `to_samples`, the
    trainer's batch) walk `chunks()`, each a contiguous zero-copy slice.
    """

    def __init__(self, table: pa.Table) -> None:
        if table.schema != SAMPLES_SCHEMA:
            # Field metadata aside, the columns must be exactly the contract's (optional ones may be absent).
            table = pa.Table.from_arrays([_column_or_nulls(table, f) for f in SAMPLES_SCHEMA], schema=SAMPLES_SCHEMA)
        self.table = table
        self._lists: dict[str, ListColumn] = {}
        self._chunks: list[tuple[int, SampleColumns]] | None = None

    def chunks(self) -> list[tuple[int, "SampleColumns"]]:
        """(first row, columns of a contiguous run of rows) covering every row in order; zero-copy."""
        if self._chunks is None:
            if all(column.num_chunks <= 1 for column in self.table.columns):
                self._chunks = [(0, self)]
            else:
                self._chunks, start = [], 0
                for batch in self.table.to_batches():
                    self._chunks.append((start, SampleColumns(pa.Table.from_batches([batch], schema=SAMPLES_SCHEMA))))
                    start += batch.num_rows
        return self._chunks

    def __len__(self) -> int:
        return self.table.num_rows

    def __repr__(self) -> str:
        return f"SampleColumns({len(self)} samples, {self.nbytes / 1e6:.1f} MB)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleColumns) and self.table.equals(other.table)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    # -- columns

    def list_column(self, name: str) -> ListColumn:
        """A per-token column as offsets + flat values: zero-copy for a single chunk, one copy of the column
        for a chunked table (walk `chunks()` to avoid it)."""
        if name not in self._lists:
            column = self.table.column(name)
            if column.num_chunks == 1:
                array = column.chunk(0)
            elif column.num_chunks:
                array = pa.concat_arrays(column.chunks)
            else:
                array = pa.array([], SAMPLES_SCHEMA.field(name).type)
            offsets = array.offsets.to_numpy().astype(np.int64)
            # `offsets` index into the unsliced `values`; rebase so row 0 starts at 0.
            values = array.values.slice(offsets[0], offsets[-1] - offsets[0])
            self._lists[name] = ListColumn(offsets - offsets[0], values.to_numpy(zero_copy_only=False))
        return self._lists[name]

    def numpy(self, name: str) -> np.ndarray:
        """A non-null scalar column (group_index, index, response_length, weight_version) as numpy."""
        return self.table.column(name).to_numpy()

    def routed_experts(self, row: int) -> np.ndarray | None:
        """Row `row`'s routed experts as int16 [tokens - 1, layers, k], or None when not recorded."""
        cell = self.table.column("routed_experts").slice(row, 1).combine_chunks()
        if not cell.is_valid()[0].as_py():
            return None
        tokens = cell.flatten()
        layers = tokens.flatten()
        flat = layers.flatten().to_numpy(zero_copy_only=False).astype(np.int16, copy=False)
        if len(tokens) == 0 or len(layers) == 0:
            return flat.reshape(len(tokens), 0, 0)
        return flat.reshape(len(tokens), len(layers) // len(tokens), -1)

    def routed_experts_rows(self) -> list[np.ndarray | None]:
        """Every row's routed experts (as `routed_experts`), as zero-copy views of the column's buffers: one
        pass over the offsets per chunk, no slice per row."""
        out: list[np.ndarray | None] = []
        for _, chunk in self.chunks():
            column = chunk.table.column("routed_experts")
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            valid = array.is_valid().to_numpy(zero_copy_only=False)
            # Three levels of offsets (rows -> tokens -> layers -> experts); each indexes its child's buffer.
            tok = array.offsets.to_numpy()
            lay = array.values.offsets.to_numpy()
            exp = array.values.values.offsets.to_numpy()
            values = array.values.values.values.to_numpy(zero_copy_only=False)
            for i in range(len(array)):
                if not valid[i]:
                    out.append(None)
                    continue
                t0, t1 = int(tok[i]), int(tok[i + 1])
                l0, l1 = int(lay[t0]), int(lay[t1])
                rows, layers = t1 - t0, l1 - l0
                flat = values[exp[l0] : exp[l1]]
                if rows == 0 or layers == 0:
                    out.append(flat.reshape(rows, 0, 0))
                else:
                    out.append(flat.reshape(rows, layers // rows, -1))
        return out

    def status_is(self, status: Status) -> np.ndarray:
        return pc.equal(self.table.column("status"), status.value).to_numpy(zero_copy_only=False)

    def scalar_rewards(self, reward_key: str | None = None) -> np.ndarray:
        """Every row's reward as one float64, as `Sample.scalar_reward(reward_key)` (dict rewards at the key)."""
        rewards = self.table.column("reward")
        out = pc.fill_null(rewards, math.nan).to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
        # Rows without a float reward hold a dict (reward_json) or nothing: JSON per such row, never per token,
        # in row order so the first bad row is the one batch_from_samples would name.
        special = np.flatnonzero(~rewards.is_valid().to_numpy(zero_copy_only=False))
        if len(special):
            groups, indices = self.numpy("group_index"), self.numpy("index")
            texts = self.table.column("reward_json").take(pa.array(special)).to_pylist()
            keys = self.table.column("reward_key").take(pa.array(special)).to_pylist()
            for row, text, key in zip(special.tolist(), texts, keys):
                where = f"Sample (group {groups[row]}, index {indices[row]})"
                if text is None:
                    raise ValueError(f"{where} has no reward yet")
                reward = _from_json(text, column="reward_json", row=row, expected=dict)
                out[row] = reward_value(reward, reward_key or key, where=where)
        return out

    def with_reward_key(self, reward_key: str) -> "SampleColumns":
        """The run's key for dict rewards set on every row that holds one (as slime's --reward-key; float
        rewards keep theirs): what train_on_artifact did to each `Sample`, as one column swap."""
        has_dict = self.table.column("reward_json").is_valid()
        keys = pc.if_else(has_dict, pa.scalar(reward_key, pa.string()), self.table.column("reward_key"))
        index = SAMPLES_SCHEMA.names.index("reward_key")
        return SampleColumns(self.table.set_column(index, SAMPLES_SCHEMA.field("reward_key"), keys))

    def metadata_flag(self, name: str) -> bool:
        """Whether some row's metadata holds a truthy `name` (JSON parsed only for rows that mention it)."""
        metadata = self.table.column("metadata")
        rows = np.flatnonzero(pc.match_substring(metadata, json.dumps(name)).to_numpy(zero_copy_only=False))
        texts = metadata.take(pa.array(rows, pa.int64())).to_pylist()
        return any(
            _from_json(text, column="metadata", row=int(row), expected=dict).get(name) for row, text in zip(rows, texts)
        )

    # -- checks

    def first_invalid(self) -> tuple[int, str] | None:
        """(row, message) of the first row that breaks the data contract, else None; vectorized over the
        buffers, the message is `Sample.validate`'s own (the offending row alone is materialised)."""
        chunks = self.chunks()
        if len(chunks) > 1:
            for start, chunk in chunks:
                found = chunk.first_invalid()
                if found is not None:
                    return start + found[0], found[1]
            return None
        n = len(self)
        if n == 0:
            return None
        resp = self.numpy("response_length")
        bad = (resp < 0) | (resp > self.list_column("tokens").lengths)
        bad |= self.list_column("loss_mask").lengths != resp
        bad |= self.list_column("rollout_log_probs").lengths != resp
        log_probs = self.list_column("rollout_log_probs")
        nan_at = np.flatnonzero(np.isnan(log_probs.values))
        if len(nan_at):
            bad[np.searchsorted(log_probs.offsets, nan_at, side="right") - 1] = True
        bad |= ~pc.is_in(self.table.column("status"), value_set=_STATUS_VALUES).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(bad)
        if not len(rows):
            return None
        row = int(rows[0])
        try:
            self.sample(row).validate()
        except ValueError as exc:
            return row, str(exc)
        return row, f"Sample row {row} breaks the data contract"  # unreachable: the checks mirror validate()

    # -- Samples, only where asked

    def sample(self, row: int) -> Sample:
        return self.to_samples([row])[0]

    def to_samples(self, rows: Sequence[int] | np.ndarray | None = None) -> list[Sample]:
        """`Sample` objects of `rows` (all by default). Raises ArtifactSchemaError naming a bad column."""
        if rows is not None:
            rows = np.asarray(rows, dtype=np.int64)
            return self.take(rows)._decode(rows.tolist())
        out: list[Sample] = []
        for start, chunk in self.chunks():
            out.extend(chunk._decode(list(range(start, start + len(chunk)))))
        return out

    def _decode(self, row_ids: list[int]) -> list[Sample]:
        """Samples of a contiguous table; `row_ids` name the rows in error messages."""
        view = self
        t = view.table
        plain = {name: t.column(name).to_pylist() for name in SAMPLES_SCHEMA.names if name not in PER_TOKEN}
        per_token = {}
        for name in PER_TOKEN:
            col = view.list_column(name)
            flat = col.values.tolist()  # Python objects for the rows asked for, built in C
            offs = col.offsets.tolist()
            per_token[name] = [flat[offs[i] : offs[i + 1]] for i in range(len(view))]
        samples: list[Sample] = []
        for i, row in enumerate(row_ids):
            prompt: Any = plain["prompt"][i]
            if plain["prompt_is_chat"][i]:
                prompt = _from_json(prompt, column="prompt", row=row, expected=list)
            reward: Any = plain["reward"][i]
            if plain["reward_json"][i] is not None:
                if reward is not None:
                    raise ArtifactSchemaError(
                        f"row {row}: both 'reward' and 'reward_json' are set; exactly one may hold the reward",
                        field="reward",
                    )
                reward = _from_json(plain["reward_json"][i], column="reward_json", row=row, expected=dict)
            try:
                status = Status.parse(plain["status"][i])
            except ValueError as exc:
                raise ArtifactSchemaError(f"row {row}: column 'status': {exc}", field="status") from None
            samples.append(
                Sample(
                    group_index=plain["group_index"][i],
                    index=plain["index"][i],
                    prompt=prompt,
                    tokens=per_token["tokens"][i],
                    response=plain["response"][i],
                    response_length=plain["response_length"][i],
                    loss_mask=per_token["loss_mask"][i],
                    rollout_log_probs=per_token["rollout_log_probs"][i],
                    reward=reward,
                    label=plain["label"][i],
                    status=status,
                    weight_version=plain["weight_version"][i],
                    reward_key=plain["reward_key"][i],
                    metadata=_from_json(plain["metadata"][i], column="metadata", row=row, expected=dict),
                    routed_experts=plain["routed_experts"][i],
                )
            )
        return samples

    def take(self, rows: Sequence[int] | np.ndarray) -> "SampleColumns":
        return SampleColumns(self.table.take(pa.array(np.asarray(rows, dtype=np.int64))).combine_chunks())

    # -- building

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> "SampleColumns":
        """Columns of `samples` (one pass per row; per-token lists are converted by Arrow in C).

        Raises ArtifactSchemaError naming the field a sample cannot store."""
        scalars: dict[str, list[Any]] = {f.name: [] for f in SAMPLES_SCHEMA if f.name not in PER_TOKEN}
        lists: dict[str, list[Any]] = {name: [] for name in PER_TOKEN}
        for position, sample in enumerate(samples):
            where = f"samples[{position}] (group {sample.group_index}, index {sample.index})"
            is_chat = not isinstance(sample.prompt, str)
            if is_chat and not isinstance(sample.prompt, list):
                raise ArtifactSchemaError(
                    f"{where}: prompt must be a str or a list of chat messages, got {type(sample.prompt).__name__}",
                    field="prompt",
                )
            if sample.label is not None and not isinstance(sample.label, str):
                raise ArtifactSchemaError(
                    f"{where}: label must be a str or None, got {type(sample.label).__name__}; "
                    "convert it (e.g. str() or json.dumps) before storing",
                    field="label",
                )
            reward, reward_json = _encode_reward(sample, where)
            scalars["group_index"].append(sample.group_index)
            scalars["index"].append(sample.index)
            scalars["prompt"].append(
                _to_json(sample.prompt, column="prompt", where=where) if is_chat else sample.prompt
            )
            scalars["prompt_is_chat"].append(is_chat)
            scalars["response"].append(sample.response)
            scalars["response_length"].append(sample.response_length)
            scalars["reward"].append(reward)
            scalars["reward_json"].append(reward_json)
            scalars["label"].append(sample.label)
            scalars["status"].append(Status.parse(sample.status).value)
            scalars["weight_version"].append(sample.weight_version)
            scalars["reward_key"].append(sample.reward_key)
            scalars["metadata"].append(_to_json(sample.metadata, column="metadata", where=where))
            routes = sample.routed_experts
            scalars["routed_experts"].append(routes.tolist() if isinstance(routes, np.ndarray) else routes)
            lists["tokens"].append(sample.tokens)
            lists["loss_mask"].append(sample.loss_mask)
            lists["rollout_log_probs"].append(sample.rollout_log_probs)
        arrays = []
        for field in SAMPLES_SCHEMA:
            values = lists[field.name] if field.name in PER_TOKEN else scalars[field.name]
            try:
                arrays.append(pa.array(values, type=field.type))
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise ArtifactSchemaError(
                    f"column {field.name!r} cannot be stored as {field.type} ({exc})", field=field.name
                ) from None
        return cls(pa.Table.from_arrays(arrays, schema=SAMPLES_SCHEMA))

    @classmethod
    def from_arrays(
        cls,
        *,
        group_index: np.ndarray,
        index: np.ndarray,
        tokens: ListColumn,
        response_length: np.ndarray,
        loss_mask: np.ndarray,
        rollout_log_probs: np.ndarray,
        reward: np.ndarray,
        status: Sequence[str] | str = Status.COMPLETED.value,
        prompt: Sequence[str] | str = "",
        weight_version: int = 0,
    ) -> "SampleColumns":
        """Columns straight from numpy (an engine's output, benchmarks): `loss_mask` and `rollout_log_probs`
        are flat over the responses (each row's last `response_length` tokens), in row order."""
        n = len(group_index)
        resp_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(response_length, out=resp_offsets[1:])

        def lst(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
            # list<> has int32 offsets: one column chunk holds < 2**31 tokens (a 67M-token rollout is fine).
            return pa.ListArray.from_arrays(
                pa.array(np.asarray(offsets, dtype=np.int32)), pa.array(values, type=type_.value_type)
            )

        def repeat(value, type_):
            return pa.array([value] * n if isinstance(value, str) else value, type=type_)

        arrays = {
            "group_index": pa.array(group_index, pa.int64()),
            "index": pa.array(index, pa.int64()),
            "prompt": repeat(prompt, pa.string()),
            "prompt_is_chat": pa.array(np.zeros(n, dtype=bool)),
            "tokens": lst(tokens.offsets, tokens.values, SAMPLES_SCHEMA.field("tokens").type),
            "response": repeat("", pa.string()),
            "response_length": pa.array(response_length, pa.int64()),
            "loss_mask": lst(resp_offsets, loss_mask, SAMPLES_SCHEMA.field("loss_mask").type),
            "rollout_log_probs": lst(resp_offsets, rollout_log_probs, SAMPLES_SCHEMA.field("rollout_log_probs").type),
            "reward": pa.array(reward, pa.float64()),
            "reward_json": pa.nulls(n, pa.string()),
            "label": pa.nulls(n, pa.string()),
            "status": repeat(status, pa.string()),
            "weight_version": pa.array(np.full(n, weight_version, dtype=np.int64)),
            "reward_key": pa.nulls(n, pa.string()),
            "metadata": repeat("{}", pa.string()),
            "routed_experts": pa.nulls(n, SAMPLES_SCHEMA.field("routed_experts").type),
        }
        return cls(pa.Table.from_arrays([arrays[f.name] for f in SAMPLES_SCHEMA], schema=SAMPLES_SCHEMA))


def _column_or_nulls(table: pa.Table, field: pa.Field):
    if field.name in OPTIONAL and field.name not in table.column_names:
        return pa.nulls(table.num_rows, field.type)
    return table.column(field.name)


# ----------------------------------------------------------------------------- per-row JSON fields


def _to_json(value: Any, *, column: str, where: str) -> str:
    try:
        # allow_nan (the default) keeps NaN/inf metrics lossless; the column is text either way.
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ArtifactSchemaError(
            f"{where}: {column} is not JSON-serializable ({exc}); {_JSON_TYPES_HINT}", field=column
        ) from None


def _encode_reward(sample: Sample, where: str) -> tuple[float | None, str | None]:
    reward = sample.reward
    if reward is None:
        return None, None
    if isinstance(reward, dict):
        return None, _to_json(reward, column="reward", where=where)
    try:  # float, int, numpy / torch scalars
        return float(reward), None
    except (TypeError, ValueError):
        raise ArtifactSchemaError(
            f"{where}: reward must be a float, a dict or None, got {type(reward).__name__}", field="reward"
        ) from None


def _from_json(text: str, *, column: str, row: int, expected: type) -> Any:
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ArtifactSchemaError(f"row {row}: column {column!r} holds invalid JSON ({exc})", field=column) from None
    if not isinstance(value, expected):
        raise ArtifactSchemaError(
            f"row {row}: column {column!r} must hold a JSON {expected.__name__}, got {type(value).__name__}",
            field=column,
        )
    return value
