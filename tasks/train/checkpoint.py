"""Trainer checkpoints on any fsspec root, with the artifacts' commit protocol.

`{root}/{run}/checkpoints/{iteration:06d}/{trainer.pt, meta.json}`: payload first, the marker
(meta.json, with the payload's sha256 and size) last; only a marker that verifies makes a checkpoint
exist. Both writes are atomic: temp file + rename on local disks (the marker is created no-clobber),
single PUTs on S3 (the marker a conditional `If-None-Match: *` PUT). A crash between the two leaves
a payload without a marker: not a checkpoint, and a resume takes the previous one. A marker that does
not parse (written in place by older versions, cut by a kill) is skipped the same way and reported.

Fault hooks (tests, drills), right after the payload of a checkpoint (of that iteration) is written:
ROLLFLOW_FAULT=checkpoint-before-marker[:ITERATION] kills the writing process (SIGKILL);
ROLLFLOW_FAULT=checkpoint-hold-before-marker[:ITERATION] parks the writer there for good, so a drill can SIGKILL the
whole `rollflow train` (driver, local Ray, actors) with the payload written and the marker not (the writer is the
trainer actor, a process of its own: killing only it would leave the driver to fail the run its own way).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import signal
import time

from rollflow.artifacts.storage import open_fs, storage_errors
from rollflow.artifacts.store import RolloutStore

PAYLOAD_NAME = "trainer.pt"
MARKER_NAME = "meta.json"
FAULT_ENV = "ROLLFLOW_FAULT"


class CheckpointError(RuntimeError):
    pass


def _fs(root: str, storage_options: dict | None):
    # Environment-derived options (AWS_ENDPOINT_URL, ...) merged under explicit ones.
    return open_fs(root, storage_options)


def _store(root: str, storage_options: dict | None):
    return RolloutStore(root, storage_options)


def checkpoint_dir(base: str, run: str, iteration: int) -> str:
    return posixpath.join(base, run, "checkpoints", f"{iteration:06d}")


def checkpoint_uri(root: str, run: str, iteration: int, name: str | None = None) -> str:
    """The checkpoint folder (or one of its files) as a URL with its scheme (s3://bucket/..., or a local path)."""
    folder = f"{root.rstrip('/')}/{run}/checkpoints/{iteration:06d}"
    return f"{folder}/{name}" if name else folder


def _rel(run: str, iteration: int, name: str) -> str:
    return f"{run}/checkpoints/{iteration:06d}/{name}"


def _fault(point: str, iteration: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    name, _, at = spec.partition(":")
    hold = point.replace("checkpoint-", "checkpoint-hold-", 1)
    if name not in (point, hold) or (at and int(at) != iteration):
        return
    if name == point:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)


# A sharded trainer's checkpoint payload: it only names the format; the state is Megatron's distributed checkpoint
# in the folder's `dist/` (written by every rank), committed by the same marker as any payload.
DIST_CHECKPOINT_FORMAT = "rollflow-megatron-dist-1"


def distributed_payload() -> bytes:
    return json.dumps({"format": DIST_CHECKPOINT_FORMAT, "dir": "dist"}).encode()


def is_distributed_payload(payload: bytes) -> bool:
    """Whether a checkpoint payload is a sharded trainer's (a JSON stub) rather than a whole state (torch.save)."""
    if not payload.startswith(b"{"):
        return False
    try:
        meta = json.loads(payload)
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == DIST_CHECKPOINT_FORMAT


def _parse_marker(data: bytes, iteration: int) -> dict:
    """The marker's dict; CheckpointError (saying what is wrong) when it does not verify."""
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"its {MARKER_NAME} is not valid JSON ({'empty file' if not data else exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) or not isinstance(meta.get("size"), int):
        raise CheckpointError(f"its {MARKER_NAME} lacks the payload's sha256 / size")
    if meta.get("iteration", iteration) != iteration:
        raise CheckpointError(f"its {MARKER_NAME} names iteration {meta.get('iteration')}")
    return meta


def save_checkpoint(
    root: str,
    run: str,
    iteration: int,
    payload: bytes,
    *,
    extra: dict | None = None,
    storage_options: dict | None = None,
) -> str:
    """Commit checkpoint `iteration`: payload, then the marker. Returns the folder (fs path, as before)."""
    fs, base = _fs(root, storage_options)
    folder = checkpoint_dir(base, run, iteration)
    store = _store(root, storage_options)
    digest = hashlib.sha256(payload).hexdigest()
    meta = {"iteration": iteration, "sha256": digest, "size": len(payload), **(extra or {})}
    marker_rel = _rel(run, iteration, MARKER_NAME)
    with storage_errors(checkpoint_uri(root, run, iteration), "writing checkpoint", fs=fs):
        if store.exists_path(marker_rel):
            try:
                old = _parse_marker(store.read_bytes(marker_rel), iteration)
            except CheckpointError:
                old = None
            if (
                old is not None
                and old["sha256"] == digest
                and old["size"] == len(payload)
                and store.exists_path(_rel(run, iteration, PAYLOAD_NAME))
            ):
                return folder  # the same checkpoint again (a retried task): already committed
            # A marker that does not verify, or a checkpoint being redone (--resume-from an earlier one):
            # withdraw the commit before its payload is replaced, so no marker ever names other bytes.
            store.delete_path(marker_rel)
        store.write_bytes(_rel(run, iteration, PAYLOAD_NAME), payload)  # atomic: temp + rename / one PUT
        _fault("checkpoint-before-marker", iteration)
        if not store.create_bytes(marker_rel, json.dumps(meta).encode()):
            raise CheckpointError(
                f"checkpoint {checkpoint_uri(root, run, iteration)} was committed by another "
                "writer meanwhile; give concurrent runs distinct run names"
            )
    return folder


def checkpoint_status(root: str, run: str, *, storage_options: dict | None = None) -> tuple[list[int], dict[int, str]]:
    """(committed iterations whose marker verifies, {iteration: why skipped} for folders whose marker does not)."""
    fs, base = _fs(root, storage_options)
    parent = posixpath.join(base, run, "checkpoints")
    good: list[int] = []
    skipped: dict[int, str] = {}
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints", "listing checkpoints", fs=fs):
        fs.invalidate_cache(parent)  # object stores cache listings; another process may have committed
        if not fs.exists(parent):
            return [], {}
        for entry in fs.ls(parent, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            if not name.isdigit():
                continue
            iteration = int(name)
            marker = posixpath.join(entry, MARKER_NAME)
            if not fs.exists(marker):
                if fs.exists(posixpath.join(entry, PAYLOAD_NAME)):
                    skipped[iteration] = "no commit marker (interrupted between payload and meta.json)"
                continue
            try:
                meta = _parse_marker(fs.cat_file(marker), iteration)
                size = fs.size(posixpath.join(entry, PAYLOAD_NAME))
            except CheckpointError as exc:
                skipped[iteration] = str(exc)
                continue
            except FileNotFoundError:
                skipped[iteration] = f"its {PAYLOAD_NAME} is missing"
                continue
            if size != meta["size"]:
                skipped[iteration] = f"its {PAYLOAD_NAME} has {size} bytes, the marker says {meta['size']}"
                continue
            good.append(iteration)
    return sorted(good), dict(sorted(skipped.items()))


def list_checkpoints(root: str, run: str, *, storage_options: dict | None = None) -> list[int]:
    return checkpoint_status(root, run, storage_options=storage_options)[0]


def latest_checkpoint(root: str, run: str, *, storage_options: dict | None = None) -> int | None:
    found = list_checkpoints(root, run, storage_options=storage_options)
    return found[-1] if found else None


def load_checkpoint_meta(root: str, run: str, iteration: int, *, storage_options: dict | None = None) -> dict:
    """The meta.json of a committed checkpoint (iteration, sha256, size, and what the run added: data cursor)."""
    fs, base = _fs(root, storage_options)
    meta_path = posixpath.join(checkpoint_dir(base, run, iteration), MARKER_NAME)
    with storage_errors(checkpoint_uri(root, run, iteration), "reading checkpoint", fs=fs):
        if not fs.exists(meta_path):
            raise CheckpointError(f"no checkpoint {iteration} for run {run!r} under {root}")
        data = fs.cat_file(meta_path)
    try:
        return _parse_marker(data, iteration)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {checkpoint_uri(root, run, iteration)} is not committed: {exc}") from None


def _earlier_hint(root: str, run: str, iteration: int, storage_options: dict | None) -> str:
    try:
        earlier = [i for i in list_checkpoints(root, run, storage_options=storage_options) if i < iteration]
    except Exception:  # noqa: BLE001 - the hint must not hide the checksum error
        earlier = []
    if earlier:
        return (
            f"; resume from the previous committed checkpoint with `rollflow train --resume-from {earlier[-1]}` "
            f"(--set resume_from={earlier[-1]}), or restore the file"
        )
    return "; restore the file, or start the run again without this checkpoint (there is no earlier one)"


def load_checkpoint(root: str, run: str, iteration: int, *, storage_options: dict | None = None) -> bytes:
    fs, base = _fs(root, storage_options)
    folder = checkpoint_dir(base, run, iteration)
    if iteration not in list_checkpoints(root, run, storage_options=storage_options):
        good, skipped = checkpoint_status(root, run, storage_options=storage_options)
        why = f" ({skipped[iteration]})" if iteration in skipped else ""
        raise CheckpointError(
            f"no committed checkpoint {iteration} for run {run!r} under {root}{why}; committed: {good or 'none'}"
        )
    meta = load_checkpoint_meta(root, run, iteration, storage_options=storage_options)
    payload_uri = checkpoint_uri(root, run, iteration, PAYLOAD_NAME)
    with storage_errors(payload_uri, "reading checkpoint", fs=fs):
        try:
            payload = fs.cat_file(posixpath.join(folder, PAYLOAD_NAME))
        except FileNotFoundError:
            payload = b""  # reported as a checksum failure below, naming the file
    digest = hashlib.sha256(payload).hexdigest()
    if digest != meta["sha256"] or len(payload) != meta["size"]:
        raise CheckpointError(
            f"checkpoint {payload_uri} fails its checksum (expected sha256 {meta['sha256']} / {meta['size']} "
            f"bytes, got {digest} / {len(payload)})" + _earlier_hint(root, run, iteration, storage_options)
        )
    return payload


def save_state(uri: str, payload: bytes, *, storage_options: dict | None = None) -> str:
    """A trainer state at an arbitrary URI, with a `.sha256` sidecar written last."""
    fs, path = open_fs(uri, storage_options)
    with storage_errors(uri, "writing trainer state", fs=fs):
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(payload)
        with fs.open(path + ".sha256", "w") as f:
            f.write(hashlib.sha256(payload).hexdigest())
    return uri


def state_exists(uri: str, *, storage_options: dict | None = None) -> bool:
    fs, path = open_fs(uri, storage_options)
    with storage_errors(uri, "checking trainer state", fs=fs):
        fs.invalidate_cache(path + ".sha256")
        return fs.exists(path + ".sha256")


def load_state(uri: str, *, storage_options: dict | None = None) -> bytes:
    fs, path = open_fs(uri, storage_options)
    with storage_errors(uri, "reading trainer state", fs=fs):
        fs.invalidate_cache(path + ".sha256")
        if not fs.exists(path + ".sha256"):
            raise CheckpointError(f"no committed trainer state at {uri}")
        payload = fs.cat_file(path)
        expected = fs.cat_file(path + ".sha256").decode().strip()
    if hashlib.sha256(payload).hexdigest() != expected:
        raise CheckpointError(f"trainer state {uri} fails its checksum; delete it to recompute")
    return payload
