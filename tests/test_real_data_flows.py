"""Dataset runs through the real flows (Prefect API + local Ray): resume continues at the same sample
across an epoch boundary, eval rollouts with their own sampling are `eval` artifacts that `rollflow
show --split eval` displays, and the alignment report's coherence check on a dataset task."""

from __future__ import annotations

import json

import pytest

from rollflow.artifacts import RolloutStore
from rollflow.tasks.rollout.settings import prompts_for
from tests.conftest import small_config
from tests.hf_fixtures import write_jsonl

pytestmark = pytest.mark.slow

# The built-in tiny model speaks the char alphabet of "012+345=": an addition set as a JSONL file.
ROWS = [
    {"prompt": f"{a:03d}+{b:03d}=", "answer": f"{a + b:04d}", "id": f"q{i}"}
    for i, (a, b) in enumerate(
        [(12, 345), (100, 200), (7, 8), (999, 1), (250, 250), (31, 415), (92, 653), (589, 79), (323, 846), (264, 338)]
    )
]


def dataset_config(tmp_path, **overrides):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    evals = write_jsonl(tmp_path / "eval.jsonl", ROWS[:3])
    data = {
        "task": "dataset",
        "path": str(train),
        "label_key": "answer",
        "metadata_keys": ["id"],
        "prompts_per_rollout": 4,
        "seed": 5,
        "eval": {"path": str(evals), "n_samples_per_prompt": 4, "temperature": 1.0, "pass_k": [1, 4]},
    }
    base = dict(
        run="ds", iterations=2, eval_every=2, data=data, rollout={"n_samples_per_prompt": 2, "reward": "exact_match"}
    )
    return small_config(tmp_path, **(base | overrides))


def meta(tmp_path, run, iteration):
    return json.loads((tmp_path / run / "checkpoints" / f"{iteration:06d}" / "meta.json").read_text())


def test_resume_continues_at_the_same_sample_across_an_epoch_boundary(tmp_path, prefect_api, ray_local):
    from rollflow.flows.train import rl_train
    from rollflow.tasks.rollout.dataset import DataResumeMismatch

    cfg = dataset_config(tmp_path)
    assert rl_train(cfg)["iterations"] == 2
    cursor = meta(tmp_path, "ds", 2)["data"]
    assert (cursor["epoch"], cursor["offset"], cursor["samples_consumed"]) == (0, 8, 8)

    # A changed batch size would continue at another sample: refused before any actor starts.
    with pytest.raises(DataResumeMismatch, match="samples_consumed: checkpoint 8, now 10"):
        rl_train(dataset_config(tmp_path, iterations=3, data={**cfg.data.model_dump(), "prompts_per_rollout": 5}))

    # The real resume: rollout 2 takes records 8, 9 of epoch 0 and then 0, 1 of the reshuffled epoch 1,
    # exactly what an uninterrupted run computes for rollout 2.
    summary = rl_train(dataset_config(tmp_path, iterations=3))
    assert summary["resumed_from"] == 2
    store = RolloutStore(str(tmp_path))
    samples = store.load("ds", "train", 2).samples
    got = [(s.metadata["data_epoch"], s.metadata["data_index"], s.metadata["id"]) for s in samples[::2]]
    want = [
        (it.metadata["data_epoch"], it.metadata["data_index"], it.metadata["id"]) for it in prompts_for(cfg.data, 2)
    ]
    assert got == want and [e for e, _, _ in got] == [0, 0, 1, 1]
    seen = [
        (s.metadata["data_epoch"], s.metadata["data_index"])
        for rid in (0, 1, 2)
        for s in store.load("ds", "train", rid).samples[::2]
    ]
    assert sorted(i for e, i in seen if e == 0) == list(range(10))  # epoch 0: every record once, none twice
    assert meta(tmp_path, "ds", 3)["data"]["epoch"] == 1 and meta(tmp_path, "ds", 3)["data"]["offset"] == 2

    # Eval: its own sampling (4 samples per prompt), an `eval` artifact, pass@k in the metrics.
    evals = store.load("ds", "eval", 0)
    assert evals.manifest.n_samples_per_prompt == 4 and len(evals.samples) == 12
    from rollflow.flows.reporting import read_metrics

    rows = read_metrics(cfg)
    assert {"eval/pass@1", "eval/pass@4", "eval/accuracy"} <= set(rows[0])
    assert 0.0 <= rows[0]["eval/pass@1"] <= rows[0]["eval/pass@4"] <= 1.0
    assert "eval/final_pass@4" in rows[-1]

    import typer
    from typer.testing import CliRunner

    from rollflow.flows.cli.tools import register

    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(app, ["show", str(tmp_path / "ds"), "--split", "eval", "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert shown["split"] == "eval" and shown["metrics"]["n_samples"] == 12


def test_coherence_on_a_dataset_task_passes_and_fails_on_shuffled_weights(tmp_path):
    """No answer-format check outside the addition task: coherence stands on printable text,
    repetition and the reference NLL, and still catches a model whose weights are shuffled."""
    from rollflow.tasks.debug.alignment import run_alignment_local
    from rollflow.tasks.debug.faults import AlignmentFaults

    cfg = dataset_config(tmp_path, run="dsalign", rollout={"n_samples_per_prompt": 4, "reward": "exact_match"})
    good = run_alignment_local(cfg).check("coherence")
    assert good.status == "pass", good.message
    assert "format_fraction" not in good.figures
    bad = run_alignment_local(cfg, faults=AlignmentFaults(gibberish_weights="shuffle")).check("coherence")
    assert bad.status == "fail" and "gibberish" in bad.message
