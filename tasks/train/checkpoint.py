"""Trainer checkpoints on any fsspec root, with the artifacts' commit protocol.

`{root}/{run}/checkpoints/{iteration:06d}/{trainer.pt, meta.json}`: payload first, meta.json last
(with the payload's sha256); only a meta.json makes a checkpoint exist.
"""

from __future__ import annotations

import hashlib
import json
import posixpath

from rollflow.artifacts.storage import open_fs, storage_errors


class CheckpointError(RuntimeError):
    pass


def _fs(root: str, storage_options: dict | None):
    # Environment-derived options (AWS_ENDPOINT_URL, ...) merged under explicit ones.
    return open_fs(root, storage_options)


def checkpoint_dir(base: str, run: str, iteration: int) -> str:
    return posixpath.join(base, run, "checkpoints", f"{iteration:06d}")


def save_checkpoint(root: str, run: str, iteration: int, payload: bytes, *, extra: dict | None = None,
                    storage_options: dict | None = None) -> str:
    fs, base = _fs(root, storage_options)
    folder = checkpoint_dir(base, run, iteration)
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints/{iteration:06d}", "writing checkpoint", fs=fs):
        fs.makedirs(folder, exist_ok=True)
        with fs.open(posixpath.join(folder, "trainer.pt"), "wb") as f:
            f.write(payload)
        meta = {"iteration": iteration, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
                **(extra or {})}
        with fs.open(posixpath.join(folder, "meta.json"), "w") as f:
            f.write(json.dumps(meta))
    return folder


def list_checkpoints(root: str, run: str, *, storage_options: dict | None = None) -> list[int]:
    fs, base = _fs(root, storage_options)
    parent = posixpath.join(base, run, "checkpoints")
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints", "listing checkpoints", fs=fs):
        fs.invalidate_cache(parent)  # object stores cache listings; another process may have committed
        if not fs.exists(parent):
            return []
        found = []
        for entry in fs.ls(parent, detail=False):
            name = posixpath.basename(entry.rstrip("/"))
            if name.isdigit() and fs.exists(posixpath.join(entry, "meta.json")):
                found.append(int(name))
    return sorted(found)


def latest_checkpoint(root: str, run: str, *, storage_options: dict | None = None) -> int | None:
    found = list_checkpoints(root, run, storage_options=storage_options)
    return found[-1] if found else None


def load_checkpoint_meta(root: str, run: str, iteration: int, *, storage_options: dict | None = None) -> dict:
    """The meta.json of a committed checkpoint (iteration, sha256, size, and what the run added: data cursor)."""
    fs, base = _fs(root, storage_options)
    meta_path = posixpath.join(checkpoint_dir(base, run, iteration), "meta.json")
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints/{iteration:06d}", "reading checkpoint", fs=fs):
        if not fs.exists(meta_path):
            raise CheckpointError(f"no checkpoint {iteration} for run {run!r} under {root}")
        return json.loads(fs.cat_file(meta_path))


def load_checkpoint(root: str, run: str, iteration: int, *, storage_options: dict | None = None) -> bytes:
    fs, base = _fs(root, storage_options)
    folder = checkpoint_dir(base, run, iteration)
    meta_path = posixpath.join(folder, "meta.json")
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints/{iteration:06d}", "reading checkpoint", fs=fs):
        exists = fs.exists(meta_path)
    if not exists:
        have = list_checkpoints(root, run, storage_options=storage_options)
        raise CheckpointError(f"no checkpoint {iteration} for run {run!r} under {root}; committed: {have or 'none'}")
    with storage_errors(f"{root.rstrip('/')}/{run}/checkpoints/{iteration:06d}", "reading checkpoint", fs=fs):
        meta = json.loads(fs.cat_file(meta_path))
        try:
            payload = fs.cat_file(posixpath.join(folder, "trainer.pt"))
        except FileNotFoundError:
            payload = b""  # reported as a checksum failure below, naming the file
    digest = hashlib.sha256(payload).hexdigest()
    if digest != meta["sha256"] or len(payload) != meta["size"]:
        raise CheckpointError(
            f"checkpoint {posixpath.join(folder, 'trainer.pt')} fails its checksum (expected sha256 "
            f"{meta['sha256']} / {meta['size']} bytes, got {digest} / {len(payload)}); restore it or resume "
            "from an earlier checkpoint"
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
