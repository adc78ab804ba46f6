"""The engine of `rollflow show` (slime's `display_debug_rollout_data`): find rollouts, recompute
their metrics, filter and page their samples.

`discover` accepts three spellings of "where the rollouts are":

- a run: ``{root}/{run}`` (``runs/myrun``, ``s3://bucket/root/myrun``): every committed rollout;
- one artifact folder: ``{root}/{run}/rollouts/{split}/{rollout_id:06d}`` (or its manifest.json);
- a slime template with ``{rollout_id}`` (``dumps/rollout_{rollout_id}.pt``), or one ``.pt`` file.

Artifacts are read columnar: the parquet payload is checksum-verified (as every load), parsed once
with pyarrow, metrics are computed on its columns with numpy, and only the rows of the printed page
become `Sample` objects. A 10,000-sample rollout pages in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollflow.artifacts.codec import arrow_owned
from rollflow.artifacts.columns import SampleColumns
from rollflow.artifacts.errors import ArtifactNotFound, format_ids
from rollflow.artifacts.pipeline_meta import WEIGHT_VERSIONS, weight_version_text
from rollflow.artifacts.sample import Sample, Status
from rollflow.artifacts.slime import discover_template_ids, expand_template, has_rollout_id, import_slime_pt
from rollflow.artifacts.store import SAMPLES_NAME, SPLITS, ArtifactRef, RolloutStore, join_uri, validate_run

# A response is "repetitive" when one token n-gram of this size occurs this often in it.
REPETITION_NGRAM = 3
REPETITION_MIN_COUNT = 3


# ----------------------------------------------------------------------------- columnar samples


class SampleTable(Sequence):
    """A read-only, lazily decoded sequence of one artifact's samples (or a filtered view of them).

    Indexing decodes only the requested rows; `rows` are the positions in the artifact.
    """

    def __init__(self, table: pa.Table, rows: np.ndarray | None = None) -> None:
        self._table = table
        self.rows = np.arange(table.num_rows, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        self._view: pa.Table | None = None

    @property
    def view(self) -> pa.Table:
        """The selected rows as a pyarrow table."""
        if self._view is None:
            if len(self.rows) == self._table.num_rows and np.array_equal(self.rows, np.arange(len(self.rows))):
                self._view = self._table
            else:
                self._view = self._table.take(pa.array(self.rows))
        return self._view

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, item: int) -> Sample: ...

    @overload
    def __getitem__(self, item: slice) -> list[Sample]: ...

    def __getitem__(self, item):
        if isinstance(item, slice):
            return self._decode(self.rows[item])
        position = range(len(self.rows))[item]  # IndexError / negative indices like a list
        return self._decode(self.rows[position : position + 1])[0]

    def __iter__(self):
        chunk = 1024
        for start in range(0, len(self.rows), chunk):
            yield from self._decode(self.rows[start : start + chunk])

    def _decode(self, rows: np.ndarray) -> list[Sample]:
        if len(rows) == 0:
            return []
        # The one decoder of columns into Samples, for the selected rows only.
        return SampleColumns(self._table).to_samples(rows)

    def select(self, positions: np.ndarray) -> "SampleTable":
        """A view of the given positions (indices into this view, not the artifact)."""
        return SampleTable(self._table, self.rows[np.asarray(positions, np.int64)])


def load_sample_table(store: RolloutStore, run: str, split: str, rollout_id: int) -> SampleTable:
    """One committed artifact as a SampleTable; checksums verified before anything is parsed."""
    return SampleTable(store.load_table(run, split, rollout_id))


# ----------------------------------------------------------------------------- discovery


@dataclasses.dataclass(frozen=True)
class RolloutLoader:
    """Loads one discovered rollout. Call it for a list of Samples; `table()` for a lazy view."""

    kind: str  # "artifact" | "slime"
    uri: str  # the artifact folder or the .pt file
    split: str
    rollout_id: int
    root: str | None = None
    run: str | None = None
    storage_options: dict[str, Any] | None = None

    def table(self) -> Sequence[Sample]:
        if self.kind == "artifact":
            store = RolloutStore(self.root, self.storage_options)
            return load_sample_table(store, self.run, self.split, self.rollout_id)
        return import_slime_pt(self.uri, self.storage_options)[1]

    def __call__(self) -> list[Sample]:
        if self.kind == "artifact":
            store = RolloutStore(self.root, self.storage_options)
            return store.load(self.run, self.split, self.rollout_id).samples
        return import_slime_pt(self.uri, self.storage_options)[1]


class Discovered(NamedTuple):
    split: str
    rollout_id: int
    loader: RolloutLoader


_EXPECTED = (
    "expected a run ({root}/{run}, e.g. runs/myrun or s3://bucket/root/myrun), an artifact folder "
    "({root}/{run}/rollouts/{split}/{rollout_id:06d}) or a slime template with {rollout_id} "
    "(e.g. dumps/rollout_{rollout_id}.pt)"
)


def _split_parent(uri: str) -> tuple[str, str]:
    text = uri.rstrip("/")
    if "/" not in text.split("://", 1)[-1]:
        return ".", text
    parent, _, last = text.rpartition("/")
    if parent.endswith(":/"):  # "s3://bucket" style: the bucket itself is the root
        parent += "/"
    return parent, last


def _discover_slime(template: str, storage_options: dict[str, Any] | None) -> list[Discovered]:
    ids = discover_template_ids(template, storage_options)
    found = [
        Discovered(
            split,
            rid,
            RolloutLoader("slime", expand_template(template, rid, split), split, rid, storage_options=storage_options),
        )
        for split in SPLITS
        for rid in ids[split]
    ]
    if not found:
        raise ArtifactNotFound(
            f"no file matches the slime template {template!r} (looked for train ids and eval_ ids in its "
            "{rollout_id} slot); check the path, or write dumps with slime's --save-debug-rollout-data"
        )
    return found


def _discover_pt_file(uri: str, storage_options: dict[str, Any] | None) -> list[Discovered]:
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    split = "eval" if "eval_" in name else "train"
    digits = re.findall(r"\d+", name)
    if digits:
        rollout_id = int(digits[-1])
    else:
        rollout_id = import_slime_pt(uri, storage_options)[0]
    return [
        Discovered(split, rollout_id, RolloutLoader("slime", uri, split, rollout_id, storage_options=storage_options))
    ]


def discover(uri_or_template: str, storage_options: dict[str, Any] | None = None) -> list[Discovered]:
    """Every rollout `uri_or_template` names, as (split, rollout_id, loader), train first, ids ascending."""
    uri = uri_or_template.strip()
    if not uri:
        raise ValueError(f"empty location; {_EXPECTED}")
    if has_rollout_id(uri):
        return _discover_slime(uri, storage_options)
    if "{" in uri and "rollout_id" in uri:
        expand_template(uri, 0)  # a malformed template: raise its message
    if uri.endswith(".pt"):
        return _discover_pt_file(uri, storage_options)

    # One artifact folder (or its manifest.json / samples.parquet)?
    if uri.rstrip("/").endswith("/" + SAMPLES_NAME):
        uri = uri.rstrip("/")[: -len(SAMPLES_NAME) - 1]
    try:
        ref = ArtifactRef.from_uri(uri)
    except ValueError:
        ref = None
    if ref is not None:
        store = RolloutStore(ref.root, storage_options)
        if not store.exists(ref.run, ref.split, ref.rollout_id):
            store.manifest(ref.run, ref.split, ref.rollout_id)  # raises ArtifactNotFound listing the ids
        loader = RolloutLoader("artifact", ref.uri, ref.split, ref.rollout_id, ref.root, ref.run, storage_options)
        return [Discovered(ref.split, ref.rollout_id, loader)]

    # A run folder ({root}/{run}), possibly given as .../{run}/rollouts[/{split}].
    text = uri.rstrip("/")
    only_split = None
    parts = text.split("/")
    if len(parts) >= 3 and parts[-2] == "rollouts" and parts[-1] in SPLITS:
        only_split, text = parts[-1], "/".join(parts[:-2])
    elif len(parts) >= 2 and parts[-1] == "rollouts":
        text = "/".join(parts[:-1])
    root, run = _split_parent(text)
    store = RolloutStore(root, storage_options)
    try:
        validate_run(run)
    except ValueError:
        raise ArtifactNotFound(f"{uri_or_template!r}: {run!r} is not a run name; {_EXPECTED}") from None
    found = []
    for split in SPLITS:
        if only_split and split != only_split:
            continue
        for rid in store.list_ids(run, split):
            loader = RolloutLoader(
                "artifact", store.artifact_uri(run, split, rid), split, rid, store.root, run, storage_options
            )
            found.append(Discovered(split, rid, loader))
    if found:
        return found
    # Nothing there: the usual mistakes are a store root instead of a run, or a typo in the run.
    nested = RolloutStore(text, storage_options).list_runs()
    if nested:
        example = join_uri(text, nested[0])
        hint = f"{uri_or_template!r} looks like a store root; runs there: {', '.join(nested)} (pass e.g. {example!r})"
    else:
        runs = store.list_runs()
        hint = f"runs under {store.root!r}: {', '.join(runs) if runs else 'none'}"
    raise ArtifactNotFound(f"no committed rollouts at {uri_or_template!r}; {hint}. {_EXPECTED}")


def ids_by_split(found: Sequence[Discovered]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {split: [] for split in SPLITS}
    for item in found:
        out[item.split].append(item.rollout_id)
    return {split: sorted(ids) for split, ids in out.items()}


def describe_ids(found: Sequence[Discovered]) -> str:
    ids = ids_by_split(found)
    return "; ".join(f"{split}: {format_ids(v)} ({len(v)})" for split, v in ids.items() if v) or "none"


class SelectionError(ValueError):
    """--split / --id name no discovered rollout."""


def select_rollout(found: Sequence[Discovered], split: str | None = None, rollout_id: int | None = None) -> Discovered:
    """Pick one rollout: the given split/id, else the latest train rollout (else the latest eval)."""
    if split is not None and split not in SPLITS:
        raise SelectionError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")
    candidates = [f for f in found if split is None or f.split == split]
    if not candidates:
        raise SelectionError(f"--split {split}: no {split} rollouts here; found {describe_ids(found)}")
    if rollout_id is None:
        by_split = ids_by_split(candidates)
        chosen_split = "train" if by_split["train"] else "eval"
        return max((f for f in candidates if f.split == chosen_split), key=lambda f: f.rollout_id)
    for wanted in ("train", "eval"):
        for item in candidates:
            if item.split == wanted and item.rollout_id == rollout_id:
                return item
    where = f"{split} " if split else ""
    raise SelectionError(f"--id {rollout_id}: no {where}rollout with that id; existing ids: {describe_ids(candidates)}")


# ----------------------------------------------------------------------------- metrics


@dataclasses.dataclass
class _Columns:
    rewards: np.ndarray  # float64, NaN where a sample has no (scalar) reward
    statuses: np.ndarray  # str
    response_lengths: np.ndarray  # int64
    groups: np.ndarray  # int64
    repetitive: np.ndarray  # bool per sample, see repetitive_mask


def _scalar_reward(reward: Any, reward_key: str | None) -> float:
    if reward is None:
        return math.nan
    if isinstance(reward, dict):
        if reward_key is None or reward_key not in reward:
            return math.nan
        reward = reward[reward_key]
    try:
        return float(reward)
    except (TypeError, ValueError):
        return math.nan


def _columns_from_table(st: SampleTable, reward_key: str | None = None) -> _Columns:
    view = st.view
    n = view.num_rows
    rewards = pc.fill_null(view.column("reward").cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)
    rewards = np.array(rewards, dtype=np.float64)
    reward_json = view.column("reward_json")
    if reward_json.null_count < n:
        keys = view.column("reward_key").to_pylist()
        for i, text in enumerate(reward_json.to_pylist()):
            if text is not None:
                rewards[i] = _scalar_reward(json.loads(text), reward_key or keys[i])
    statuses = np.array(view.column("status").to_pylist(), dtype=object)
    lengths = view.column("response_length").to_numpy().astype(np.int64)
    groups = view.column("group_index").to_numpy().astype(np.int64)
    return _Columns(rewards, statuses, lengths, groups, _repetitive_by_chunks(view, lengths))


# Rows per pass of the repetition check: its n-gram keys and sort take ~40 bytes per response token, so
# a 67M-token rollout is scanned a few million tokens at a time instead of all at once.
_REPETITION_TOKENS_PER_PASS = 2 << 20


def _repetitive_by_chunks(view: pa.Table, lengths: np.ndarray) -> np.ndarray:
    """repetitive_mask over the table's rows, a bounded number of response tokens per pass (exact: the
    check is per sample)."""
    out = np.zeros(len(lengths), dtype=bool)
    for start, chunk in SampleColumns(view).chunks():
        tokens = chunk.list_column("tokens")
        rows_total = len(chunk)
        done = 0
        while done < rows_total:
            # as many rows as fit in the pass (at least one)
            budget = np.cumsum(lengths[start + done : start + rows_total])
            take = max(1, int(np.searchsorted(budget, _REPETITION_TOKENS_PER_PASS, side="right")))
            rows = slice(done, done + take)
            offsets = tokens.offsets[rows.start : rows.stop + 1]
            values = tokens.values[offsets[0] : offsets[-1]].astype(np.int64)
            flat, owner = _response_spans(values, offsets - offsets[0], lengths[start + done : start + done + take])
            out[start + done : start + done + take] = repetitive_mask(flat, owner, take)
            done += take
    return out


def _response_spans(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The response tokens (last `lengths[i]` of each row) and the row each belongs to."""
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = offsets[1:] - lengths
    owner = np.repeat(np.arange(n, dtype=np.int64), lengths)
    # position within the response, then the absolute index into `values`
    within = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return values[np.repeat(starts, lengths) + within], owner


def _columns_from_samples(samples: Sequence[Sample], reward_key: str | None = None) -> _Columns:
    rewards = np.array([_scalar_reward(s.reward, reward_key or s.reward_key) for s in samples], dtype=np.float64)
    statuses = np.array([Status.parse(s.status).value for s in samples], dtype=object)
    lengths = np.array([s.response_length for s in samples], dtype=np.int64)
    groups = np.array([s.group_index for s in samples], dtype=np.int64)
    flat = np.fromiter((t for s in samples for t in s.response_tokens), dtype=np.int64, count=int(lengths.sum()))
    owner = np.repeat(np.arange(len(samples), dtype=np.int64), lengths)
    return _Columns(rewards, statuses, lengths, groups, repetitive_mask(flat, owner, len(samples)))


def _columns(samples: Sequence[Sample], reward_key: str | None = None) -> _Columns:
    if isinstance(samples, SampleTable):
        return _columns_from_table(samples, reward_key)
    return _columns_from_samples(list(samples), reward_key)


def repetitive_mask(
    tokens: np.ndarray,
    owner: np.ndarray,
    n_samples: int,
    *,
    ngram: int = REPETITION_NGRAM,
    min_count: int = REPETITION_MIN_COUNT,
) -> np.ndarray:
    """Per sample: does some token `ngram`-gram occur >= `min_count` times (overlaps count) in its response?

    `tokens` are the responses concatenated, `owner[i]` the sample of token i (non-decreasing).
    """
    out = np.zeros(n_samples, dtype=bool)
    m = len(tokens) - ngram + 1
    if m <= 0:
        return out
    same = owner[:m] == owner[ngram - 1 :]  # the n-gram does not cross a response boundary
    base = int(tokens.max(initial=0)) + 1
    # Exact keys while base**ngram fits in 64 bits (any vocabulary below ~2.6M for 3-grams); beyond
    # that the multiply wraps, i.e. a hash whose collisions are negligible for this purpose.
    mult = np.uint64(base if base**ngram < 2**64 else 1_000_003)
    key = np.zeros(m, dtype=np.uint64)
    for k in range(ngram):
        key = key * mult + tokens[k : k + m].astype(np.uint64)
    key, who = key[same], owner[:m][same]
    if len(key) == 0:
        return out
    order = np.lexsort((key, who))
    key, who = key[order], who[order]
    new_run = np.ones(len(key), dtype=bool)
    new_run[1:] = (key[1:] != key[:-1]) | (who[1:] != who[:-1])
    starts = np.flatnonzero(new_run)
    counts = np.diff(np.append(starts, len(key)))
    out[who[starts[counts >= min_count]]] = True
    return out


def _num(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def rollout_metrics(samples: Sequence[Sample], reward_key: str | None = None) -> dict[str, Any]:
    """Recomputed rollout metrics (JSON-able; None where undefined, e.g. no rewards yet).

    - response_len_mean/min/max: response tokens per sample;
    - truncated_ratio: fraction of samples with status truncated;
    - reward_mean/std/min/max over samples with a scalar reward (dict rewards at `reward_key`, the run's
      rollout.reward_key / eval_reward_key as slime, else at the sample's own reward_key;
      std is the population std), n_scored how many had one;
    - zero_std_groups: groups (by group_index) with >= 2 scored samples whose rewards are all equal
      (they give GRPO no signal); zero_std_group_fraction is over groups with >= 2 scored samples;
    - repetition_fraction: fraction of responses in which some 3-gram of token ids occurs 3+ times;
    - status_counts: samples per status (every status listed).
    """
    cols = _columns(samples, reward_key)
    n = len(cols.response_lengths)
    status_counts = {s.value: int(np.count_nonzero(cols.statuses == s.value)) for s in Status}
    scored = ~np.isnan(cols.rewards)
    rewards = cols.rewards[scored]

    zero_std = eligible = 0
    if rewards.size:
        groups = cols.groups[scored]
        order = np.lexsort((rewards, groups))
        g, r = groups[order], rewards[order]
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        sizes = np.diff(np.r_[starts, len(g)])
        lows, highs = r[starts], r[starts + sizes - 1]  # sorted by reward within each group
        eligible = int(np.count_nonzero(sizes >= 2))
        zero_std = int(np.count_nonzero((sizes >= 2) & (lows == highs)))

    repetitive = cols.repetitive
    lengths = cols.response_lengths
    return {
        "n_samples": n,
        "n_groups": int(len(np.unique(cols.groups))),
        "response_len_mean": _num(float(lengths.mean())) if n else None,
        "response_len_min": int(lengths.min()) if n else None,
        "response_len_max": int(lengths.max()) if n else None,
        "truncated_ratio": status_counts[Status.TRUNCATED.value] / n if n else None,
        "n_scored": int(rewards.size),
        "reward_mean": float(rewards.mean()) if rewards.size else None,
        "reward_std": float(rewards.std()) if rewards.size else None,
        "reward_min": float(rewards.min()) if rewards.size else None,
        "reward_max": float(rewards.max()) if rewards.size else None,
        "zero_std_groups": zero_std,
        "zero_std_group_fraction": zero_std / eligible if eligible else None,
        "repetition_fraction": float(repetitive.mean()) if n else None,
        "status_counts": status_counts,
        **_turn_stats(samples),
    }


def _turn_records(samples: Sequence[Sample]) -> list[list[dict[str, Any]]]:
    """The turn records of the samples that have any (metadata JSON parsed only for those rows)."""
    if isinstance(samples, SampleTable):
        column = samples.view.column("metadata")
        rows = np.flatnonzero(pc.match_substring(column, '"turns"').to_numpy(zero_copy_only=False))
        texts = column.take(pa.array(rows, pa.int64())).to_pylist()
        return [t for t in (json.loads(text).get("turns") or [] for text in texts) if t]
    return [t for t in ((s.metadata or {}).get("turns") or [] for s in samples) if t]


def _turn_stats(samples: Sequence[Sample]) -> dict[str, Any]:
    """Multi-turn rollouts (rollout functions) only: how many conversations used tools, and how it went."""
    records = _turn_records(samples)
    if not records:
        return {}
    tools = [t for turns in records for t in turns if t.get("role") == "tool"]
    return {
        "multi_turn_fraction": sum(len(turns) > 1 for turns in records) / len(samples),
        "turns_mean": sum(len(turns) for turns in records) / len(records),
        "tool_calls": len(tools),
        "tool_failures": sum(1 for t in tools if t.get("ok") is False),
    }


# ----------------------------------------------------------------------------- filters


def filter_positions(
    samples: Sequence[Sample],
    status: str | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    reward_key: str | None = None,
    min_turns: int | None = None,
) -> np.ndarray:
    """Positions of the samples passing every filter. A reward filter drops unscored samples. `min_turns`:
    conversations (rollout functions, docs/agents.md) with at least that many turns."""
    cols_needed = status is not None or reward_min is not None or reward_max is not None
    if not cols_needed and min_turns is None:
        return np.arange(len(samples), dtype=np.int64)
    if isinstance(samples, SampleTable):
        view = samples.view
        statuses = np.array(view.column("status").to_pylist(), dtype=object)
        rewards = (
            _columns_from_table(samples, reward_key).rewards
            if (reward_min is not None or reward_max is not None)
            else None
        )
    else:
        statuses = np.array([Status.parse(s.status).value for s in samples], dtype=object)
        rewards = np.array([_scalar_reward(s.reward, reward_key or s.reward_key) for s in samples], dtype=np.float64)
    keep = np.ones(len(samples), dtype=bool)
    if min_turns is not None:
        keep &= _turn_counts(samples) >= min_turns
    if status is not None:
        try:
            wanted = Status.parse(status).value
        except ValueError as exc:
            raise ValueError(f"--status {status!r}: {exc}") from None
        keep &= statuses == wanted
    if reward_min is not None:
        keep &= ~np.isnan(rewards) & (rewards >= reward_min)
    if reward_max is not None:
        keep &= ~np.isnan(rewards) & (rewards <= reward_max)
    return np.flatnonzero(keep)


def _turn_counts(samples: Sequence[Sample]) -> np.ndarray:
    """Turns per sample (0 for single-turn samples)."""
    if isinstance(samples, SampleTable):
        column = samples.view.column("metadata")
        rows = np.flatnonzero(pc.match_substring(column, '"turns"').to_numpy(zero_copy_only=False))
        counts = np.zeros(len(samples), dtype=np.int64)
        for row, text in zip(rows, column.take(pa.array(rows, pa.int64())).to_pylist()):
            counts[row] = len(json.loads(text).get("turns") or [])
        return counts
    return np.array([len((s.metadata or {}).get("turns") or []) for s in samples], dtype=np.int64)


def filter_samples(
    samples: Sequence[Sample],
    status: str | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    reward_key: str | None = None,
    min_turns: int | None = None,
) -> Sequence[Sample]:
    """The samples with the given status and a reward in [reward_min, reward_max] (bounds optional).

    A SampleTable in gives a (lazy) SampleTable out; a list gives a list.
    """
    positions = filter_positions(samples, status, reward_min, reward_max, reward_key, min_turns)
    if isinstance(samples, SampleTable):
        return samples.select(positions)
    items = list(samples)
    return [items[i] for i in positions]


# ----------------------------------------------------------------------------- rendering


def _page(samples: Sequence[Sample], limit: int, offset: int) -> list[tuple[int, Sample]]:
    if limit < 0 or offset < 0:
        raise ValueError(f"--limit {limit} / --offset {offset}: both must be >= 0")
    page = samples[offset : offset + limit]
    if isinstance(samples, SampleTable):
        rows = samples.rows[offset : offset + limit].tolist()
    else:
        rows = list(range(offset, offset + len(page)))
    return list(zip(rows, page))


def shorten(text: str, max_chars: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_chars else text[: max(0, max_chars - 1)] + "\u2026"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    try:  # chat messages: show the last user turn, which is what differs between samples
        return " | ".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    except AttributeError:
        return json.dumps(prompt, ensure_ascii=False)


def _response_text(sample: Sample) -> str:
    """The response; a multi-turn sample's turns marked: [assistant] 12+45= [tool calc ok] 57 [assistant] 0357."""
    turns = sample.metadata.get("turns") if isinstance(sample.metadata, dict) else None
    if not turns:
        return sample.response
    parts = []
    for t in turns:
        tag = t.get("role", "?")
        if tag == "tool":
            tag += f" {t.get('name', '?')} {'ok' if t.get('ok', True) else 'failed'}"  # the error: --json
        if t.get("reward") is not None:
            tag += f" r={float(t['reward']):.3g}"
        parts.append(f"[{tag}] {t.get('text', '')}")
    return " ".join(parts)


def _reward_text(sample: Sample) -> str:
    if sample.reward is None:
        return "-"
    if isinstance(sample.reward, dict):
        return json.dumps(sample.reward, ensure_ascii=False)
    return f"{float(sample.reward):.4g}"


def page_records(samples: Sequence[Sample], limit: int = 20, offset: int = 0) -> list[dict[str, Any]]:
    """The page as JSON-able dicts: {"row": position in the artifact, **sample.to_dict()}."""
    return [{"row": row, **sample.to_dict()} for row, sample in _page(samples, limit, offset)]


def render_table(
    samples: Sequence[Sample],
    limit: int = 20,
    offset: int = 0,
    *,
    max_chars: int = 48,
    json_mode: bool = False,
    title: str | None = None,
):
    """One page of samples: a rich Table (prompt / response / reward / status / metadata), cell text
    cut at `max_chars`; with `json_mode` a JSON string of `page_records` instead."""
    if json_mode:
        return json.dumps(page_records(samples, limit, offset), ensure_ascii=False)
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title) if title else None, show_lines=False, expand=False)
    table.add_column("row", justify="right", no_wrap=True)
    table.add_column("group", justify="right", no_wrap=True)
    table.add_column("prompt", overflow="fold")
    table.add_column("response", overflow="fold")
    table.add_column("len", justify="right", no_wrap=True)
    table.add_column("reward", justify="right", no_wrap=True)
    table.add_column("label", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("weights", overflow="fold")  # weight version per token run: v0x12+v1x40 (partial rollouts)
    table.add_column("metadata", overflow="fold")
    for row, sample in _page(samples, limit, offset):
        # turns: in the response cell; weight_versions: in the weights cell
        shown = {k: v for k, v in (sample.metadata or {}).items() if k not in ("turns", WEIGHT_VERSIONS)}
        metadata = json.dumps(shown, ensure_ascii=False, separators=(",", ":")) if shown else ""
        cells = (
            str(row),
            str(sample.group_index),
            shorten(_prompt_text(sample.prompt), max_chars),
            shorten(_response_text(sample), max_chars),
            str(sample.response_length),
            shorten(_reward_text(sample), max_chars),
            shorten(sample.label or "", max_chars),
            Status.parse(sample.status).value,
            weight_version_text(sample),
            shorten(metadata, max_chars),
        )
        # Text, not str: sample text is data, a "[bold]" in a response must not become markup.
        table.add_row(*(Text(c) for c in cells))
    return table


def render_metrics(metrics: dict[str, Any], title: str | None = None):
    """The metrics dict as a two-column rich Table."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title) if title else None, show_header=False)
    table.add_column("metric", no_wrap=True)
    table.add_column("value", no_wrap=True)
    for key, value in metrics.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(Text(key), Text("-" if value is None else str(value)))
    return table


__all__ = [
    "Discovered",
    "RolloutLoader",
    "SampleTable",
    "SelectionError",
    "describe_ids",
    "discover",
    "filter_positions",
    "filter_samples",
    "ids_by_split",
    "load_sample_table",
    "page_records",
    "render_metrics",
    "render_table",
    "repetitive_mask",
    "rollout_metrics",
    "select_rollout",
]


def train_dump_summary(loader: RolloutLoader) -> dict[str, Any] | None:
    """Means of the `--dump-details` per-token train tensors of this rollout, if a dump exists.

    Dumps live at `{root}/{run}/train_dumps/{rollout_id:06d}.parquet` next to the rollouts.
    """
    if loader.kind != "artifact" or loader.split != "train" or not loader.root or not loader.run:
        return None
    import pyarrow.compute as pc

    store = RolloutStore(loader.root, loader.storage_options)
    rel = f"{loader.run}/train_dumps/{loader.rollout_id:06d}.parquet"
    if not store.exists_path(rel):
        return None
    with store.open(rel, "rb") as f:
        data = f.read()

    # Not the Python file object: Arrow's threads would call into Python (see codec.arrow_owned).
    table = pq.read_table(pa.BufferReader(arrow_owned(data)), pre_buffer=False)
    summary: dict[str, Any] = {"uri": store.path_uri(rel), "rows": table.num_rows}
    for name in ("log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns"):
        if name in table.column_names and table.column(name).null_count < table.num_rows:
            flat = pc.list_flatten(table.column(name))
            summary[f"mean_{name}"] = _num(float(pc.mean(flat).as_py())) if len(flat) else None
    if {"log_probs", "ref_log_probs"} <= set(table.column_names):
        lp = pc.list_flatten(table.column("log_probs"))
        ref = pc.list_flatten(table.column("ref_log_probs"))
        if len(lp) and len(lp) == len(ref):
            summary["max_abs_log_probs_minus_ref"] = _num(float(pc.max(pc.abs(pc.subtract(lp, ref))).as_py()))
    return summary
