"""Checkpoints are committed like rollouts: payload first, the meta.json marker last, atomically (issue 17).

A small trainer loop in a subprocess saves a checkpoint per iteration through
`rollflow.tasks.train.checkpoint`; the fault hook kills it (SIGKILL) between the payload and the
marker of checkpoint 3; the resumed loop takes checkpoint 2 and ends with the same weights as an
uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.tasks.train.checkpoint import (
    CheckpointError,
    checkpoint_status,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

LOOP = r"""
import io, sys, torch
from rollflow.tasks.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
root, run, total, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
start = latest_checkpoint(root, run) or 0
if start:
    state = torch.load(io.BytesIO(load_checkpoint(root, run, start)), weights_only=True)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
print(f"resumed from {start}", flush=True)
for it in range(start + 1, total + 1):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(it))
    loss = (model(x) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    buf = io.BytesIO(); torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    save_checkpoint(root, run, it, buf.getvalue(), extra={"data": {"next_rollout_id": it}})
torch.save(model.state_dict(), out)
"""


def run_loop(tmp_path: Path, root: Path, run: str, out: str, fault: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLOW_FAULT"}
    if fault:
        env["ROLLFLOW_FAULT"] = fault
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.run(
        [sys.executable, str(script), str(root), run, "4", str(tmp_path / out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_kill_between_payload_and_marker_resumes_from_previous(tmp_path):
    import torch

    root = tmp_path / "store"
    clean = run_loop(tmp_path, root, "clean", "clean.pt")
    assert clean.returncode == 0, clean.stderr

    killed = run_loop(tmp_path, root, "crash", "never.pt", fault="checkpoint-before-marker:3")
    assert killed.returncode == -signal.SIGKILL
    folder = root / "crash" / "checkpoints" / "000003"
    assert (folder / "trainer.pt").exists() and not (folder / "meta.json").exists()
    committed, skipped = checkpoint_status(str(root), "crash")
    assert committed == [1, 2] and "no commit marker" in skipped[3]
    assert not (tmp_path / "never.pt").exists()
    # Only payloads and markers: no temp file survived the kill.
    assert all(Path(p).name in ("trainer.pt", "meta.json") for p in tree(root / "crash"))

    resumed = run_loop(tmp_path, root, "crash", "resumed.pt")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from 2" in resumed.stdout
    a, b = torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint_status(str(root), "crash") == ([1, 2, 3, 4], {})


def test_unreadable_marker_is_skipped_and_named(tmp_path):
    root = str(tmp_path)
    for it in (1, 2):
        save_checkpoint(root, "r", it, f"payload {it}".encode())
    # What older versions left after a kill while writing meta.json in place: an empty marker.
    folder = tmp_path / "r" / "checkpoints" / "000003"
    folder.mkdir(parents=True)
    (folder / "trainer.pt").write_bytes(b"payload 3")
    (folder / "meta.json").write_text("")
    committed, skipped = checkpoint_status(root, "r")
    assert committed == [1, 2] and latest_checkpoint(root, "r") == 2
    assert "meta.json is not valid JSON (empty file)" in skipped[3]
    with pytest.raises(CheckpointError, match="no committed checkpoint 3 .*empty file.*committed: \\[1, 2\\]"):
        load_checkpoint(root, "r", 3)
    # Saving iteration 3 again replaces the bad marker: committed.
    save_checkpoint(root, "r", 3, b"payload 3")
    assert checkpoint_status(root, "r") == ([1, 2, 3], {})
    assert json.loads((folder / "meta.json").read_text())["size"] == len(b"payload 3")


def test_corrupt_payload_offers_resume_from_previous(tmp_path):
    root = str(tmp_path)
    for it in (1, 2):
        save_checkpoint(root, "r", it, f"payload {it}".encode())
    before = tree(tmp_path)
    payload = tmp_path / "r" / "checkpoints" / "000002" / "trainer.pt"
    payload.write_bytes(b"payload X")  # same size, other bytes: only the checksum catches it
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root, "r", 2)
    message = str(info.value)
    assert "fails its checksum" in message and "--resume-from 1" in message and "resume_from=1" in message
    assert "\n" not in message
    assert set(tree(tmp_path)) == set(before)  # nothing written or removed by the failed load


def test_same_checkpoint_again_is_a_no_op(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, "r", 1, b"abc")
    before = tree(tmp_path)
    save_checkpoint(root, "r", 1, b"abc")
    assert tree(tmp_path) == before


def test_resume_from_config_and_cli_flag():
    from rollflow.flows.config import load_config

    assert load_config(None, ["resume_from=2"]).resume_from == 2
