"""Checkpoints are committed like rollouts: payload first, the meta.json marker last, atomically (issue 17).

A small trainer loop in a subprocess saves a checkpoint per iteration through
`rollflow.tasks.train.checkpoint`; the fault hook kills it (SIGKILL) between the payload and the
marker of checkpoint 3; the resumed loop takes checkpoint 2 and ends with the same weights as an
uninterrupted run. The same kill through the product (issue 36 item 6): a real `rollflow train`, its whole
session SIGKILLed while the trainer is held between payload and marker, then the same command again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
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
    from rollflow.flows.config_loading import load_config

    assert load_config(None, ["resume_from=2"]).resume_from == 2


# ---- through `rollflow train` -------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def train_cmd(root: Path, run: str, iterations: int, *sets: str) -> list[str]:
    """`rollflow train` on the embedded default config, sized small; `sets`: more `--set` items (later win)."""
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train"]
    for item in (
        f"run={run}",
        f"iterations={iterations}",
        f"store.root={root}",
        "data.prompts_per_rollout=8",
        "rollout.n_samples_per_prompt=2",
        "train.num_steps_per_rollout=1",
        *sets,
    ):
        cmd += ["--set", item]
    return cmd


def train_env(prefect_api: str, fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLFLOW_FAULT"}
    env.update(PREFECT_API_URL=prefect_api, PYTHONUNBUFFERED="1")
    if fault:
        env["ROLLFLOW_FAULT"] = fault
    return env


def sigkill_at_held_checkpoint(cmd: list[str], env: dict[str, str], payload: Path, timeout: float = 300) -> str:
    """Start `cmd` in its own session; once `payload` exists (the trainer, held by the fault hook, has written it
    and will never write its marker), SIGKILL the whole session: driver, local Ray and actors. Returns the output."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout
        while not payload.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert alive and payload.exists(), f"never reached the held checkpoint:\n{output[-3000:]}"
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, output[-3000:])
    return output


def summary_of(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") : stdout.index("}") + 1])


def checkpoint_state(root: Path, run: str, iteration: int) -> dict:
    import torch

    return torch.load(io.BytesIO(load_checkpoint(str(root), run, iteration)), weights_only=True)


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Nested dicts / lists of tensors and plain values: equal keys, tensors equal bit for bit (dtype included)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        # as raw bytes: torch.equal calls NaN unequal to itself and -0.0 equal to 0.0
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
def test_rollflow_train_killed_between_payload_and_marker_resumes_from_previous(tmp_path, prefect_api):
    """`rollflow train` SIGKILLed (driver, Ray, actors) with checkpoint 2's payload written and its marker not; the
    same command again resumes from checkpoint 1, never reads the orphan payload, and ends with the weights (and
    optimizer state) of a run that was never interrupted. The killed run tracks to a local MLflow store: the
    resume continues the same MLflow run (its id kept in `{run}/tracking.json`), which ends FINISHED with one
    point per committed step and no gap."""
    import torch
    from mlflow.tracking import MlflowClient

    from tests.test_tracking import mlflow_steps

    root = tmp_path / "store"
    two_steps = "train.num_steps_per_rollout=2"  # two optimizer steps per iteration: MLflow's step axis is checked
    reference = subprocess.run(
        train_cmd(root, "straight", 3, two_steps),
        cwd=REPO,
        env=train_env(prefect_api),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert checkpoint_status(str(root), "straight") == ([1, 2, 3], {})

    tracking = ['tracking.backends=["mlflow"]', f"tracking.uri={tmp_path / 'mlruns'}", "tracking.project=rollflow-test"]
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"  # what a folder as tracking.uri means (flows/tracking.py)
    cmd = train_cmd(root, "crash", 3, two_steps, *tracking)
    folder = root / "crash" / "checkpoints" / "000002"
    sigkill_at_held_checkpoint(cmd, train_env(prefect_api, "checkpoint-hold-before-marker:2"), folder / "trainer.pt")
    assert not (folder / "meta.json").exists()
    committed, skipped = checkpoint_status(str(root), "crash")
    assert committed == [1] and "no commit marker" in skipped[2], (committed, skipped)
    # Only payloads and markers: the kill left no temp file a later listing or load could trip on.
    assert {p.name for p in (root / "crash" / "checkpoints").rglob("*") if p.is_file()} == {"trainer.pt", "meta.json"}
    with pytest.raises(CheckpointError, match="no committed checkpoint 2 .*no commit marker"):
        load_checkpoint(str(root), "crash", 2)
    # Nothing ran to end the MLflow run: it shows RUNNING, with the committed iteration only (iteration 2's row was
    # in metrics.jsonl when the kill came, but its checkpoint never committed, so it was never logged).
    run_id = json.loads((root / "crash" / "tracking.json").read_text())["mlflow_run_id"]
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "RUNNING"
    logged = mlflow_steps(uri, run_id)
    assert sorted(s for s, keys in logged.items() if "train/loss" in keys) == [1]
    assert sorted(s for s, keys in logged.items() if "train_step/loss" in keys) == [1, 2]
    # The orphan holds what the trainer had after iteration 2, which a correct resume recomputes bit for bit; shift
    # its weights so that a resume reading it (instead of recomputing) cannot end with the reference's weights.
    orphan = torch.load(folder / "trainer.pt", weights_only=True)
    orphan["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in orphan["model"].items()}
    torch.save(orphan, folder / "trainer.pt")

    resumed = subprocess.run(cmd, cwd=REPO, env=train_env(prefect_api), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = summary_of(resumed.stdout)
    assert summary["resumed_from"] == 1 and summary["iterations"] == 3, summary
    assert checkpoint_status(str(root), "crash") == ([1, 2, 3], {})
    metrics = [json.loads(line) for line in (root / "crash" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    for iteration in (1, 2, 3):
        assert_bitwise_equal(
            checkpoint_state(root, "crash", iteration),
            checkpoint_state(root, "straight", iteration),
            f"ckpt{iteration}",
        )

    assert json.loads((root / "crash" / "tracking.json").read_text())["mlflow_run_id"] == run_id
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("rollflow-test").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["rollflow.resumed_from"] == "1"
    assert {"train/loss", "train_step/loss", "train_step/grad_norm"} <= set(run.data.metrics)
    for key in run.data.metrics:
        # optimizer steps: 2 per iteration, numbered on across the resume (iteration 2's are 3 and 4)
        want = [1, 2, 3, 4, 5, 6] if key.startswith("train_step/") else [1, 2, 3]
        assert sorted(p.step for p in client.get_metric_history(run_id, key)) == want, key
    # Each committed iteration's values as metrics.jsonl holds them: iteration 2's, logged after the resume, are
    # those of its rerun, not of the killed attempt.
    rows = {m["iteration"]: m for m in metrics}
    for point in client.get_metric_history(run_id, "train/loss"):
        assert point.value == rows[point.step]["train/loss"]
