"""slime compatibility: its `--save-debug-rollout-data` `.pt` dumps <-> rollflow `Sample`s.

slime writes, per rollout, ``torch.save({"rollout_id": id, "samples": [sample.to_dict(), ...]},
T.format(rollout_id=id))`` where ``T`` is the `--save-debug-rollout-data` template and eval rollouts
use the id text ``eval_{id}``. This module reads and writes exactly that shape:

- `import_slime_pt` loads with ``torch.load(weights_only=True)`` only: a file that would need an
  arbitrary Python object (anything beyond tensors and plain containers) is refused before any of
  its code can run. rollflow only reads plain-data `.pt` files.
- `export_slime_pt` writes plain Python types only (lists, dicts, str, int, float, bool, None), so
  slime's `Sample.from_dict` loads the result and so does our importer.

Mapping (lossless in both directions):

- Fields slime has and rollflow does not (``spec_info``, ``train_metadata``, ...) are kept in
  ``metadata["extra_fields"]`` on import and written back as top-level keys on export.
- slime's ``weight_versions`` (a list of strings) gives ``weight_version`` (its last entry, as an
  int); the list itself is kept when it is anything but ``[str(weight_version)]``.
- A dump without ``rollout_log_probs`` / ``loss_mask`` (slime's default is None) gets zeros / ones
  of ``response_length`` and ``metadata["rollout_log_probs_missing"] = True`` (resp.
  ``"loss_mask_missing"``); export writes None back for them. Consumers that need behaviour
  log-probs (TIS, the train-vs-rollout diff) must check the flag.
- Statuses: slime writes ``"completed"`` (or ``"Status.COMPLETED"`` in older dumps); both parse.
  slime's ``"pending"`` has no rollflow counterpart: it imports as ``aborted`` with
  ``metadata["slime_status"] = "pending"`` and exports as ``"pending"`` again.
- A non-string label (slime allows any) is stored as JSON text with ``metadata["slime_label_json"]``.
- ``rollout_routed_experts`` (MoE routing replay: expert ids ``[len(tokens) - 1, layers, top-k]``, a
  tensor or nested lists; slime's own numpy array is not plain data and is refused with the file) is
  ``Sample.routed_experts``, the artifact's int16 column; export writes nested int lists back.

Templates: `expand_template` fills ``{rollout_id}`` (``eval_{id}`` for the eval split, as slime);
`discover_template_ids` globs a template through fsspec, so ``s3://`` templates work too.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

from fsspec.core import url_to_fs

from .codec import samples_to_parquet_bytes
from .digests import hexdigest
from .errors import ArtifactError, ArtifactNotFound, ArtifactSchemaError
from .manifest import EngineInfo
from .sample import Sample, Status
from .store import ArtifactRef

SPLITS = ("train", "eval")
EVAL_PREFIX = "eval_"

# metadata keys this module owns; they are consumed on export instead of being written out.
EXTRA_FIELDS_KEY = "extra_fields"
LOG_PROBS_MISSING_KEY = "rollout_log_probs_missing"
LOSS_MASK_MISSING_KEY = "loss_mask_missing"
SLIME_STATUS_KEY = "slime_status"
LABEL_JSON_KEY = "slime_label_json"


class SlimeTemplateError(ArtifactError, ValueError):
    """A `--save/--load-debug-rollout-data` template is malformed or names no existing file."""


# ----------------------------------------------------------------------------- templates


def _template_fields(template: str) -> list[tuple[str, str | None, str]]:
    """(literal_text, field_name, format_spec) tuples; raises SlimeTemplateError on bad syntax."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SlimeTemplateError(
            f"template {template!r} is not a valid format string ({exc}); write literal braces as '{{{{' and '}}}}'"
        ) from None
    out = []
    for literal, name, spec, conversion in parsed:
        if name is not None and name != "rollout_id":
            raise SlimeTemplateError(
                f"template {template!r} has an unknown placeholder {{{name}}}; the only placeholder is "
                "{rollout_id}, e.g. 'dumps/rollout_{rollout_id}.pt'"
            )
        if conversion:
            raise SlimeTemplateError(f"template {template!r}: conversions like '!{conversion}' are not supported")
        out.append((literal, name, spec or ""))
    return out


def has_rollout_id(template: str) -> bool:
    """True when `template` contains a `{rollout_id}` placeholder (with or without a format spec)."""
    try:
        return any(name == "rollout_id" for _, name, _ in _template_fields(template))
    except SlimeTemplateError:
        return False


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    return split


def expand_template(template: str, rollout_id: int, split: str = "train") -> str:
    """Fill `{rollout_id}` like slime: the id for train, ``eval_{id}`` for eval.

    A format spec is applied to the integer (``{rollout_id:06d}`` -> ``000007`` / ``eval_000007``).
    """
    _check_split(split)
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, int) or rollout_id < 0:
        raise ValueError(f"rollout_id={rollout_id!r}: expected an integer >= 0")
    fields = _template_fields(template)
    if not any(name == "rollout_id" for _, name, _ in fields):
        raise SlimeTemplateError(
            f"--load-debug-rollout-data template {template!r} has no {{rollout_id}} placeholder; every "
            "rollout needs its own file: add it, e.g. 'dumps/rollout_{rollout_id}.pt'"
        )
    parts = []
    for literal, name, spec in fields:
        parts.append(literal)
        if name == "rollout_id":
            try:
                text = format(rollout_id, spec)
            except ValueError as exc:
                raise SlimeTemplateError(
                    f"template {template!r}: format spec {spec!r} does not apply to an integer id ({exc})"
                ) from None
            parts.append(EVAL_PREFIX + text if split == "eval" else text)
    return "".join(parts)


_SENTINEL = "ROLLFLOWRIDPLACEHOLDER"


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", text)


def discover_template_ids(template: str, storage_options: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """Rollout ids with an existing file for `template`, per split: ``{"train": [...], "eval": [...]}``."""
    fields = _template_fields(template)
    if not any(name == "rollout_id" for _, name, _ in fields):
        expand_template(template, 0)  # raises the standard "has no {rollout_id}" error
    # One glob for both splits (the id slot becomes '*'), then a regex picks ids out of the matches.
    glob_text = "".join(_glob_escape(lit) + ("*" if name else "") for lit, name, _ in fields)
    marked = "".join(lit + (_SENTINEL if name else "") for lit, name, _ in fields)
    fs, glob_path = url_to_fs(glob_text, **(storage_options or {}))
    marked_path = fs._strip_protocol(marked)
    pieces = marked_path.split(_SENTINEL)
    regex = re.compile("^" + r"(eval_)?(\d+)".join(re.escape(p) for p in pieces) + "$")
    try:
        fs.invalidate_cache()
        matches = fs.glob(glob_path)
    except FileNotFoundError:
        matches = []
    found: dict[str, set[int]] = {split: set() for split in SPLITS}
    for path in matches:
        m = regex.match(path.rstrip("/"))
        if not m:
            continue
        groups = m.groups()
        prefixes, ids = groups[0::2], groups[1::2]
        # A template may use {rollout_id} more than once: every occurrence must agree.
        if len(set(prefixes)) != 1 or len({int(i) for i in ids}) != 1:
            continue
        found["eval" if prefixes[0] else "train"].add(int(ids[0]))
    return {split: sorted(ids) for split, ids in found.items()}


# ----------------------------------------------------------------------------- import


def _plain(value: Any) -> Any:
    """Tensors -> lists/numbers, tuples -> lists; everything else as is (recursively)."""
    if type(value).__module__.startswith("torch") and hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _refusal(uri: str, exc: BaseException) -> ArtifactSchemaError:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    # torch's message is long; the line naming the offending global is the part that helps.
    found = re.search(r"WeightsUnpickler error: ([^\n]+?)(?: Please use|\n|$)", text)
    reason = found.group(1) if found else (text.strip().splitlines() or [type(exc).__name__])[0]
    return ArtifactSchemaError(
        "refusing to load this .pt file: it contains pickled Python objects beyond tensors and plain "
        "containers, and rollflow refuses to unpickle arbitrary objects (that would run code from the "
        "file). rollflow only reads plain-data .pt files (torch.load(weights_only=True)): re-save the "
        "dump as dicts/lists/str/numbers/tensors, e.g. slime's sample.to_dict(). "
        f"(torch: {reason.strip()[:300]})",
        field="pt",
        uri=uri,
    )


def read_pt_bytes(path_or_url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The raw bytes of a `.pt` file at any fsspec URL (ArtifactNotFound when there is none)."""
    fs, path = url_to_fs(path_or_url, **(storage_options or {}))
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise ArtifactNotFound(f"no slime .pt file at {path_or_url!r}") from None


def load_plain_pt(path_or_url: str, storage_options: dict[str, Any] | None = None, *, data: bytes | None = None) -> Any:
    """`torch.load(weights_only=True)` of any fsspec URL (or of its bytes, `data`); code-carrying pickles
    are refused."""
    if data is None:
        data = read_pt_bytes(path_or_url, storage_options)
    import torch  # lazily: `rollflow show` of parquet artifacts should not pay torch's import

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(path_or_url, exc) from None
    except (RuntimeError, AttributeError, TypeError) as exc:
        # torch raises these for unsupported globals in some versions, and for non-pickle bytes.
        if "weights_only" in str(exc) or "Unsupported" in str(exc) or "global" in str(exc).lower():
            raise _refusal(path_or_url, exc) from None
        raise ArtifactSchemaError(f"not a readable torch .pt file ({exc})", field="pt", uri=path_or_url) from None
    except (EOFError, ValueError, OSError) as exc:
        raise ArtifactSchemaError(f"not a readable torch .pt file ({exc})", field="pt", uri=path_or_url) from None


def _weight_version(raw: dict[str, Any], where: str) -> tuple[int, Any]:
    """(weight_version, weight_versions to keep as an extra field or None)."""
    versions = raw.get("weight_versions")
    if "weight_version" in raw and raw["weight_version"] is not None:
        try:
            version = int(raw["weight_version"])
        except (TypeError, ValueError):
            raise ArtifactSchemaError(
                f"{where}: weight_version={raw['weight_version']!r} is not an integer", field="weight_version"
            ) from None
    else:
        version = 0
        if versions:
            try:
                version = int(str(versions[-1]).strip())
            except (TypeError, ValueError):
                version = 0  # free-form version labels: keep them verbatim in extra_fields
    keep = versions if "weight_versions" in raw and versions != [str(version)] else None
    return version, keep


def slime_dict_to_sample(raw: dict[str, Any], *, position: int = 0, uri: str | None = None) -> Sample:
    """One slime `Sample.to_dict()` -> rollflow Sample (see the module doc for the mapping)."""
    where = f"samples[{position}]"
    if not isinstance(raw, dict):
        raise ArtifactSchemaError(
            f"{where} is a {type(raw).__name__}, expected a dict (slime's Sample.to_dict())", field="samples", uri=uri
        )
    raw = _plain(raw)
    data = dict(raw)
    metadata = data.pop("metadata", None) or {}
    if not isinstance(metadata, dict):
        raise ArtifactSchemaError(
            f"{where}: metadata is a {type(metadata).__name__}, expected a dict", field="metadata", uri=uri
        )
    metadata = dict(metadata)
    extra: dict[str, Any] = dict(metadata.pop(EXTRA_FIELDS_KEY, None) or {})

    tokens = data.get("tokens")
    if tokens is None:
        raise ArtifactSchemaError(f"{where}: tokens is missing (prompt + response token ids)", field="tokens", uri=uri)
    response_length = data.get("response_length")
    if response_length is None:
        raise ArtifactSchemaError(f"{where}: response_length is missing", field="response_length", uri=uri)
    response_length = int(response_length)

    status_raw = data.pop("status", Status.COMPLETED.value)
    if str(getattr(status_raw, "value", status_raw)).lower().removeprefix("status.") == "pending":
        status = Status.ABORTED
        metadata[SLIME_STATUS_KEY] = "pending"
    else:
        try:
            status = Status.parse(status_raw)
        except ValueError as exc:
            raise ArtifactSchemaError(f"{where}: {exc}", field="status", uri=uri) from None

    version, keep_versions = _weight_version(data, where)
    data.pop("weight_versions", None)
    if keep_versions is not None:
        extra["weight_versions"] = keep_versions

    if data.get("rollout_log_probs") is None:
        data["rollout_log_probs"] = [0.0] * response_length
        metadata[LOG_PROBS_MISSING_KEY] = True
    if data.get("loss_mask") is None:
        data["loss_mask"] = [1] * response_length
        metadata[LOSS_MASK_MISSING_KEY] = True

    label = data.get("label")
    if label is not None and not isinstance(label, str):
        data["label"] = json.dumps(label)
        metadata[LABEL_JSON_KEY] = True

    # MoE routing replay: slime's int32 [len(tokens) - 1, layers, top-k], rollflow's layout too (a None
    # stays an extra field, so it round-trips as written).
    routed = data.pop("rollout_routed_experts") if data.get("rollout_routed_experts") is not None else None
    index = data.pop("index", None)
    prompt = data.pop("prompt", None)
    known = {
        "group_index": int(data.pop("group_index", None) or 0),
        "index": position if index is None else int(index),
        "prompt": "" if prompt is None else prompt,
        "tokens": data.pop("tokens"),
        "response": data.pop("response", None) or "",
        "response_length": response_length,
        "loss_mask": data.pop("loss_mask"),
        "rollout_log_probs": data.pop("rollout_log_probs"),
        "reward": data.pop("reward", None),
        "label": data.pop("label", None),
        "status": status,
        "weight_version": version,
        "reward_key": data.pop("reward_key", None),
        "routed_experts": routed,
    }
    data.pop("weight_version", None)
    data.pop("response_length", None)
    extra.update(data)  # whatever is left is a field rollflow does not model
    if extra:
        metadata[EXTRA_FIELDS_KEY] = extra
    known["metadata"] = metadata
    try:
        sample = Sample.from_dict(known)
        sample.validate()
    except (TypeError, ValueError) as exc:
        raise ArtifactSchemaError(f"{where}: {exc}", field="samples", uri=uri) from None
    return sample


def import_slime_pt(
    path_or_url: str, storage_options: dict[str, Any] | None = None, *, data: bytes | None = None
) -> tuple[int, list[Sample]]:
    """Read one slime debug-rollout dump: (rollout_id, samples). Only plain-data .pt files load."""
    payload = load_plain_pt(path_or_url, storage_options, data=data)
    if not isinstance(payload, dict) or "samples" not in payload:
        found = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ArtifactSchemaError(
            f"expected slime's debug rollout dump {{'rollout_id': int, 'samples': [dict, ...]}}, found {found}",
            field="samples",
            uri=path_or_url,
        )
    raw_samples = payload["samples"]
    if not isinstance(raw_samples, (list, tuple)):
        raise ArtifactSchemaError(
            f"'samples' is a {type(raw_samples).__name__}, expected a list of dicts", field="samples", uri=path_or_url
        )
    rollout_id = _plain(payload.get("rollout_id", 0))
    try:
        rollout_id = int(str(rollout_id).removeprefix(EVAL_PREFIX))
    except (TypeError, ValueError):
        raise ArtifactSchemaError(
            f"rollout_id={rollout_id!r} is not an integer", field="rollout_id", uri=path_or_url
        ) from None
    samples = [slime_dict_to_sample(raw, position=i, uri=path_or_url) for i, raw in enumerate(raw_samples)]
    return rollout_id, samples


# ----------------------------------------------------------------------------- checks and content-addressed import


class TokenOutOfVocab(ArtifactSchemaError):
    """A sample holds a token id the model cannot embed (>= its vocabulary size, or negative)."""


def check_token_ids(
    samples: Sequence[Sample] | Any,
    vocab_size: int | None,
    *,
    rollout_id: int,
    split: str = "train",
    uri: str | None = None,
) -> None:
    """One line naming the rollout, the sample, the largest id and the vocab size when an id is out of range."""
    if not vocab_size:
        return
    if not isinstance(samples, (list, tuple)) and type(samples).__name__ == "SampleColumns":
        # One vectorized pass over the token buffers, chunk by chunk (columns.py needs numpy, pyarrow).
        import numpy as np

        for start, chunk in samples.chunks():
            column = chunk.list_column("tokens")
            bad = np.flatnonzero((column.values >= vocab_size) | (column.values < 0))
            if len(bad):
                row = int(np.searchsorted(column.offsets, bad[0], side="right") - 1)
                _check_sample_tokens(start + row, chunk.sample(row), vocab_size, rollout_id, split, uri)
        return
    for position, sample in enumerate(samples):
        _check_sample_tokens(position, sample, vocab_size, rollout_id, split, uri)


def _check_sample_tokens(
    position: int, sample: Sample, vocab_size: int, rollout_id: int, split: str, uri: str | None
) -> None:
    if sample.tokens:
        largest, smallest = max(sample.tokens), min(sample.tokens)
        if largest >= vocab_size or smallest < 0:
            bad = largest if largest >= vocab_size else smallest
            raise TokenOutOfVocab(
                f"{split} rollout {rollout_id}, sample {position} (group {sample.group_index}, index {sample.index}): "
                f"token id {bad} is outside the model's vocabulary (vocab size {vocab_size}, largest id in the "
                f"sample {largest}); the dump was made with another tokenizer or model",
                field="tokens",
                uri=uri,
            )


class SlimeImportConflict(ArtifactError, ValueError):
    """A slime dump's content differs from what the run imported for the same rollout id earlier."""


SOURCE_SHA_KEY = "source_sha256"


def _payload_digest(samples: Sequence[Sample], algorithm: str) -> str:
    return hexdigest(samples_to_parquet_bytes(list(samples)), algorithm)


def import_slime_into_store(
    store: Any,
    run: str,
    split: str,
    rollout_id: int,
    source: str,
    *,
    backend: str = "slime",
    model: str = "unknown",
    config_hash: str | None = None,
    n_samples_per_prompt: int | None = None,
    vocab_size: int | None = None,
    new_run_hint: str = "import it into a new run",
    storage_options: dict[str, Any] | None = None,
) -> tuple[Any, bool]:
    """Import one slime dump as artifact (run, split, rollout_id), content-addressed: (ref, imported_now).

    The dump's sha256 is recorded in the manifest (`extra.source_sha256`). The same content again is a
    no-op; different content under an id the run already holds raises `SlimeImportConflict` naming both
    checksums (a run never silently keeps training on an old import). `backend` / `model` go into the
    manifest's engine info (its weight version is the samples' latest).
    """
    from collections import Counter

    data = read_pt_bytes(source, storage_options)
    digest = hashlib.sha256(data).hexdigest()
    ref = ArtifactRef(store.root, run, split, rollout_id)
    existing = store.manifest(run, split, rollout_id) if store.exists(run, split, rollout_id) else None
    if existing is not None and existing.extra.get(SOURCE_SHA_KEY) == digest:
        return ref, False
    _, samples = import_slime_pt(source, storage_options, data=data)
    if existing is not None:
        old = existing.extra.get(SOURCE_SHA_KEY)
        if old is None:  # imported before content addressing: compare what was stored
            algorithm, stored = existing.file("samples.parquet").integrity
            # The payload's bytes depend on the codec's version: compare the samples if they differ.
            same = stored == _payload_digest(samples, algorithm)
            if same or store.load(run, split, rollout_id).samples == samples:
                return ref, False
            old = f"unknown (payload {algorithm} {stored})"
        raise SlimeImportConflict(
            f"{source} (sha256 {digest}) differs from what run {run!r} imported as {split} rollout {rollout_id} "
            f"(sha256 {old}, from {existing.extra.get('imported_from', '?')}); refusing to use the old import: "
            f"{new_run_hint}, or delete {ref.uri}"
        )
    check_token_ids(samples, vocab_size, rollout_id=rollout_id, split=split, uri=source)
    if n_samples_per_prompt is None:
        sizes = Counter(Counter(s.group_index for s in samples).values())
        n_samples_per_prompt = sizes.most_common(1)[0][0] if sizes else 1
    engine = EngineInfo(
        backend=backend, model=model, weight_version=max((s.weight_version for s in samples), default=0)
    )
    store.write(
        run,
        split,
        rollout_id,
        samples,
        n_samples_per_prompt=n_samples_per_prompt,
        engine=engine,
        config_hash=config_hash or f"slime-import-{digest[:16]}",
        extra={"imported_from": source, SOURCE_SHA_KEY: digest},
    )
    return ref, True


# ----------------------------------------------------------------------------- export


def sample_to_slime_dict(sample: Sample) -> dict[str, Any]:
    """rollflow Sample -> the dict slime's `Sample.to_dict()` would have written (plain types only)."""
    metadata = json.loads(json.dumps(sample.metadata))  # a deep, plain copy
    extra = metadata.pop(EXTRA_FIELDS_KEY, None) or {}
    log_probs_missing = bool(metadata.pop(LOG_PROBS_MISSING_KEY, False))
    loss_mask_missing = bool(metadata.pop(LOSS_MASK_MISSING_KEY, False))
    slime_status = metadata.pop(SLIME_STATUS_KEY, None)
    label_json = bool(metadata.pop(LABEL_JSON_KEY, False))
    label: Any = sample.label
    if label_json and isinstance(label, str):
        label = json.loads(label)
    out: dict[str, Any] = {
        "group_index": int(sample.group_index),
        "index": int(sample.index),
        "prompt": json.loads(json.dumps(sample.prompt)),
        "tokens": [int(t) for t in sample.tokens],
        "response": sample.response,
        "response_length": int(sample.response_length),
        "label": label,
        "reward": json.loads(json.dumps(sample.reward)) if isinstance(sample.reward, dict) else sample.reward,
        "loss_mask": None if loss_mask_missing else [int(x) for x in sample.loss_mask],
        "weight_versions": [str(sample.weight_version)],
        "rollout_log_probs": None if log_probs_missing else [float(x) for x in sample.rollout_log_probs],
        "status": slime_status or Status.parse(sample.status).value,
        "metadata": metadata,
    }
    out["weight_version"] = int(sample.weight_version)
    out["reward_key"] = sample.reward_key
    if sample.routed_experts is not None:
        out["rollout_routed_experts"] = [
            [[int(e) for e in layer] for layer in token] for token in sample.routed_experts
        ]
    for key, value in extra.items():
        out[key] = value  # back to top level, as slime had them (weight_versions included)
    return out


def export_slime_pt(
    samples: Iterable[Sample],
    rollout_id: int,
    path_or_url: str,
    *,
    split: str = "train",
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write one rollout as slime's debug dump; `path_or_url` may be a `{rollout_id}` template.

    Returns the URL written. The file holds plain Python types only.
    """
    _check_split(split)
    target = expand_template(path_or_url, rollout_id, split) if has_rollout_id(path_or_url) else path_or_url
    import torch

    payload = {"rollout_id": int(rollout_id), "samples": [sample_to_slime_dict(s) for s in samples]}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    fs, path = url_to_fs(target, **(storage_options or {}))
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, buffer.getvalue())
    return target


def export_many(rollouts: Sequence[tuple[str, int, Sequence[Sample]]], template: str, **kwargs: Any) -> list[str]:
    """Export several (split, rollout_id, samples) through one `{rollout_id}` template."""
    if len(rollouts) > 1 and not has_rollout_id(template):
        expand_template(template, 0)  # the standard error naming the template
    return [export_slime_pt(samples, rid, template, split=split, **kwargs) for split, rid, samples in rollouts]
