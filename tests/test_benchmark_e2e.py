"""The end-to-end iteration suite's CPU path (issue 37) at the built-in tiny shape, so the GPU suite cannot rot.

Runs the one command a GPU box runs (`python -m benchmarks --suite e2e`) in a child process (the megatron
backend initialises torch.distributed, which must not leak into this one), then checks its JSON against what
can be computed without the suite's own definitions: the rollouts it committed, the stage names of
`rl_iteration`, and the figures re-derived from the raw per-iteration times.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.artifacts.store import RolloutStore

REPO = Path(__file__).resolve().parents[1]
# rl_iteration's stages under placement=colocate, offload=true (flows/iteration.py), checkpoint left out
ITERATION_STAGES = {
    "generate",
    "reward",
    "persist",
    "engine_release",
    "trainer_onload",
    "load",
    "train",
    "engine_resume_weights",
    "sync",
    "parity",
    "trainer_offload",
    "engine_resume_kv",
}
STEADY = 2


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    out, work = tmp / "e2e.json", tmp / "work"
    # The tensor path (what a GPU run takes by default): buckets handed over in process, serialized between actors
    command = [sys.executable, "-m", "benchmarks", "--suite", "e2e", "--quick", "--repeats", str(STEADY)]
    command += ["--weight-sync", "tensor"]
    command += ["--out", str(out), "--workdir", str(work), "--no-table", "--threads", "1"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)  # Ray actors start too
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())["suites"]["e2e"], work, proc.stderr


def figure(suite: dict, name: str) -> dict:
    return next(f for f in suite["figures"] if f["name"] == name)


def test_every_stage_is_timed_and_the_stages_fit_in_the_iteration(e2e_run):
    suite, _, _ = e2e_run
    assert not suite.get("error"), suite.get("error")
    assert suite["params"]["shape"] == "tiny" and suite["params"]["device"] == "cpu"
    assert suite["params"]["weight_sync"] == "tensor"
    assert suite["params"]["train_backend"] in ("megatron", "torch")  # which one ran is stated
    iterations = suite["data"]["iterations"]
    assert [it["rollout_id"] for it in iterations] == list(range(1 + STEADY))
    for it in iterations:
        assert set(it["seconds"]) == ITERATION_STAGES
        assert all(s > 0 for s in it["seconds"].values()), it["seconds"]
        assert 0 < sum(it["seconds"].values()) <= it["iteration_s"]
        assert it["parity_ok"] is True
        assert it["peak_bytes"] == {}  # no GPU memory to measure on CPU
    assert suite["data"]["startup_s"] > 0


def test_token_counts_match_the_committed_rollouts(e2e_run):
    suite, work, _ = e2e_run
    p = suite["params"]
    store = RolloutStore(str(work / "e2e-store-tiny"))
    assert store.list_ids("e2e", "train") == list(range(1 + STEADY))
    for it in suite["data"]["iterations"]:
        samples = store.load("e2e", "train", it["rollout_id"]).samples
        assert len(samples) == it["samples"] == p["prompts"] * p["samples_per_prompt"]
        assert it["generated_tokens"] == sum(len(s.rollout_log_probs) for s in samples)
        assert all(0 < s.response_length <= p["new_tokens"] for s in samples)


def test_figures_follow_from_the_raw_times(e2e_run):
    suite, _, printed = e2e_run
    first, *steady = suite["data"]["iterations"]
    iteration = [it["iteration_s"] for it in steady]
    assert figure(suite, "iteration s (steady)")["values"] == pytest.approx(iteration)
    assert figure(suite, "iteration s (first)")["values"] == pytest.approx([first["iteration_s"]])
    ratio = figure(suite, "first / steady iteration")
    assert ratio["median"] == pytest.approx(first["iteration_s"] / statistics.median(iteration))
    assert ratio["goal"]["target"] == 1.5 and ratio["meets_goal"] == (ratio["median"] <= 1.5)
    tokens = figure(suite, "generated tokens/s per GPU")["values"]
    assert tokens == pytest.approx([it["generated_tokens"] / it["iteration_s"] for it in steady])
    shares = [
        (it["iteration_s"] - it["seconds"]["generate"] - it["seconds"]["train"]) / it["iteration_s"] for it in steady
    ]
    overhead = figure(suite, "overhead share")
    assert overhead["values"] == pytest.approx(shares) and all(0 < s < 1 for s in shares)
    assert overhead["goal"]["target"] == 0.05
    parity = figure(suite, "parity s")
    assert parity["values"] == pytest.approx([it["seconds"]["parity"] for it in steady])
    assert parity["goal"]["target"] == 0.2
    for stage in ITERATION_STAGES:
        assert stage in printed  # the plain-text stage table a bare GPU box prints


def test_the_same_iterations_through_ray_actors_do_the_same_work_and_say_what_ray_adds(e2e_run):
    """Where Ray is installed the suite runs the iterations again with both workers as Ray actors behind
    rl_iteration's clients: the same rollouts committed, the same train metrics, each stage timed, and the
    difference per rollout id reported."""
    suite, work, _ = e2e_run
    local, ray = suite["data"]["iterations"], suite["data"]["ray"]["iterations"]
    assert [it["rollout_id"] for it in ray] == [it["rollout_id"] for it in local]
    for a, b in zip(local, ray):
        assert set(b["seconds"]) == ITERATION_STAGES and b["parity_ok"] is True
        assert 0 < sum(b["seconds"].values()) <= b["iteration_s"]
        assert b["train_metrics"] == a["train_metrics"] and "train/loss" in b["train_metrics"]
    store, ray_store = RolloutStore(str(work / "e2e-store-tiny")), RolloutStore(str(work / "e2e-store-tiny-ray"))
    assert ray_store.list_ids("e2e", "train") == list(range(1 + STEADY))
    for rollout_id in range(1 + STEADY):
        ours = [s.tokens for s in store.load("e2e", "train", rollout_id).samples]
        assert [s.tokens for s in ray_store.load("e2e", "train", rollout_id).samples] == ours
    added = figure(suite, "ray: added s per iteration (steady)")["values"]
    assert added == pytest.approx([b["iteration_s"] - a["iteration_s"] for a, b in zip(local[1:], ray[1:])])
    assert figure(suite, "ray: sync s")["values"] == pytest.approx([b["seconds"]["sync"] for b in ray[1:]])
    assert suite["data"]["ray"]["startup_s"] > 0


def test_rollflow_bench_finds_the_checkout_and_passes_the_shape_on(tmp_path):
    """`rollflow bench` runs `python -m benchmarks` from the checkout, with --shape for the e2e suite."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "rollflow.flows.cli", "bench", "--suite", "e2e", "--shape", "no-such-shape"]
    proc = subprocess.run(command + ["--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    suite = json.loads(out.read_text())["suites"]["e2e"]
    assert "no-such-shape" in suite["error"]


def test_the_cuda_only_figures_are_built_from_per_stage_peaks():
    """The GPU branch of the figures (peak memory per stage), on hand-made iterations: it cannot rot on CPU CI."""
    from benchmarks.core import SuiteResult
    from benchmarks.e2e_iteration import IterationTimes
    from benchmarks.suite_e2e import add_figures

    def iteration(rollout_id: int, scale: float, peak_stage: str, peak_gib: int) -> IterationTimes:
        seconds = {stage: 0.01 * scale for stage in ITERATION_STAGES} | {"generate": 2.0 * scale, "train": 1.0}
        peaks = {stage: 2**30 for stage in ITERATION_STAGES} | {peak_stage: peak_gib * 2**30}
        return IterationTimes(rollout_id, seconds, peaks, sum(seconds.values()) + 0.05, 64, 640, True)

    runs = [iteration(0, 3.0, "generate", 40), iteration(1, 1.0, "sync", 30), iteration(2, 1.0, "train", 35)]
    res = SuiteResult("e2e", "t")
    add_figures(res, runs, startup_s=1.0, cuda=True)
    d = res.to_dict()
    peak = next(f for f in d["figures"] if f["name"] == "peak GPU memory GiB")
    assert peak["values"] == [40.0, 30.0, 35.0]
    assert "peak GPU memory of the first iteration: 40.0 GiB, in stage generate" in d["notes"]
    assert "peak GPU memory of the steady iterations: 35.0 GiB, in stage train" in d["notes"]
    ratio = next(f for f in d["figures"] if f["name"] == "first / steady iteration")
    assert ratio["median"] == pytest.approx(runs[0].iteration_s / runs[1].iteration_s)


def test_a_failing_stage_is_named_and_the_finished_iterations_are_kept(tmp_path, monkeypatch):
    """A shape that does not fit (an out-of-memory error in some stage) still reports what it measured. In process,
    with the torch trainer: the path a box without megatron-core takes (`--train-backends torch` chooses it)."""
    import benchmarks.e2e_iteration as e2e_iteration
    import benchmarks.suite_e2e as suite_e2e
    from benchmarks.core import BenchContext

    real_release = e2e_iteration.RolloutWorker.release_memory
    calls = []

    def release_fails_the_second_time(self):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("CUDA out of memory (simulated)")
        return real_release(self)

    monkeypatch.setattr(e2e_iteration.RolloutWorker, "release_memory", release_fails_the_second_time)
    ctx = BenchContext(quick=True, repeats=2, workdir=tmp_path, options={"train_backends": ["torch"]})
    res = suite_e2e.run(ctx)
    assert res.error == "iteration 1, stage engine_release: MemoryError: CUDA out of memory (simulated)"
    assert [it["rollout_id"] for it in res.data["iterations"]] == [0]
    assert set(res.data["iterations"][0]["seconds"]) == ITERATION_STAGES
    assert res.params["train_backend"] == "torch"
    assert res.data["startup_s"] > 0 and not res.figures
