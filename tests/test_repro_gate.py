"""The bitwise reproducibility gate and the group-diversity guard (issue 35, acceptance 3).

The pure comparisons on inputs built here by hand; one slow end-to-end run of the gate through Prefect and Ray
(passes on the embedded default, fails naming the first differing value with injected logit noise, and the
diversity guard fails with greedy sampling under temperature > 0)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollflow.tasks.debug.repro import (
    DIVERSITY,
    REPRO,
    IterationTrace,
    RunTrace,
    diversity_check,
    first_difference,
    repro_check,
    same_bits,
)
from tests.conftest import small_config


def _iteration(rollout_id: int = 0) -> IterationTrace:
    return IterationTrace(
        rollout_id=rollout_id,
        tokens=[[1, 2, 3], [1, 2, 4], [5, 6], [5, 7]],
        rewards=[1.0, 0.0, 0.5, 0.25],
        rollout_log_probs=[[-0.1, -0.2], [-0.1, -0.3], [-0.4], [-0.5]],
        records={"advantage": [0.7, -0.7, 0.7, -0.7], "log_prob_sum": [-0.3, -0.4, -0.4, -0.5]},
        metrics={"train/loss": 0.125, "perf/iteration_s": 3.0, "rollout_uri": "/x"},
        steps=[{"train_step/loss": 0.5, "step": 1}, {"train_step/loss": 0.25, "step": 2}],
    )


def _trace(run: str = "a") -> RunTrace:
    return RunTrace(
        run,
        [_iteration(0), _iteration(1)],
        {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)},
    )


def test_identical_runs_pass():
    a, b = _trace("a"), _trace("b")
    b.iterations[1].metrics["perf/iteration_s"] = 9.0  # wall time never counts
    b.iterations[1].metrics["rollout_uri"] = "/y"
    assert first_difference(a, b) is None
    result = repro_check(a, b)
    assert result.name == REPRO and result.passed, result.message


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda t: t.iterations[1].tokens[2].__setitem__(1, 9), (2, "token ids", "sample 2 token 1", 6, 9)),
        (lambda t: t.iterations[0].rewards.__setitem__(3, 0.5), (1, "reward", "sample 3", 0.25, 0.5)),
        (
            lambda t: t.iterations[0].rollout_log_probs[1].__setitem__(1, -0.30000001),
            (1, "rollout log-probs", "sample 1 token 1", -0.3, -0.30000001),
        ),
        (
            lambda t: t.iterations[1].records["log_prob_sum"].__setitem__(0, -0.3 + 1e-16),
            (2, "train log_prob_sum", "sample 0", -0.3, -0.3 + 1e-16),
        ),
        (
            lambda t: t.iterations[0].steps[1].__setitem__("train_step/loss", 0.2500001),
            (1, "train_step/loss", "step 2", 0.25, 0.2500001),
        ),
        (
            lambda t: t.iterations[1].metrics.__setitem__("train/loss", -0.125),
            (2, "train/loss", "metrics.jsonl", 0.125, -0.125),
        ),
    ],
)
def test_first_difference_names_iteration_field_position_and_both_values(change, expected):
    a, b = _trace("a"), _trace("b")
    change(b)
    diff = first_difference(a, b)
    assert diff is not None
    assert (diff.iteration, diff.field, diff.where, diff.a, diff.b) == expected
    result = repro_check(a, b)
    assert result.failed and f"iteration {expected[0]}" in result.message and expected[1] in result.message


def test_the_first_of_several_differences_is_reported():
    a, b = _trace("a"), _trace("b")
    b.iterations[1].rewards[0] = 0.0
    b.iterations[0].metrics["train/loss"] = 1.0  # earlier iteration, later field: still first
    diff = first_difference(a, b)
    assert (diff.iteration, diff.field) == (1, "train/loss")


def test_weights_compared_bit_for_bit():
    a, b = _trace("a"), _trace("b")
    b.weights = copy.deepcopy(b.weights)
    b.weights["b"][1] = -0.0  # equal as a value, not as bits
    diff = first_difference(a, b)
    assert (diff.iteration, diff.field, diff.where) == (None, "tensor", "b element 1")
    assert "final weights" in diff.describe()
    b.weights = {"w": a.weights["w"].clone()}
    assert first_difference(a, b).where == "b"  # a tensor only one run has


def test_same_bits():
    assert same_bits(0.1, 0.1) and same_bits(float("nan"), float("nan")) and same_bits(3, 3)
    assert not same_bits(0.0, -0.0) and not same_bits(0.1, 0.1 + 1e-17 * 10) and not same_bits(None, 0.0)


def _groups(identical: int, n_groups: int = 4, size: int = 4) -> IterationTrace:
    tokens = []
    for g in range(n_groups):
        tokens += [[g, 1]] * size if g < identical else [[g, k] for k in range(size)]
    it = _iteration(0)
    it.tokens = tokens
    return it


def test_diversity_guard():
    ok = diversity_check([_groups(1)], 4, 1.0)  # a confident policy: a few identical groups
    assert ok.name == DIVERSITY and ok.passed
    bad = diversity_check([_groups(1), _groups(4)], 4, 1.0)
    assert bad.failed and "iteration 1: 4 of 4 prompt groups" in bad.message and bad.figures["fraction"] == 1.0
    assert diversity_check([_groups(4)], 4, 0.0).passed  # greedy on purpose: nothing to guard
    assert diversity_check([_groups(3)], 4, 1.0, max_fraction=0.5).failed


@pytest.mark.slow
def test_gate_end_to_end(tmp_path, prefect_api, ray_local):
    from rollflow.flows.repro_gate import run_repro_gate
    from rollflow.tasks.debug.faults import AlignmentFaults

    cfg = small_config(tmp_path, run="gate", iterations=2, train={"num_steps_per_rollout": 2})
    repro, diversity = run_repro_gate(cfg)
    assert repro.passed, repro.message
    assert diversity.passed, diversity.message
    assert repro.figures["iterations"] == 2 and repro.figures["tensors"] > 0

    # the faults show in iteration 1: one iteration per pass is enough
    cfg = small_config(tmp_path, run="gate", iterations=1, train={"num_steps_per_rollout": 2})
    noisy, _ = run_repro_gate(cfg, AlignmentFaults(nondeterministic_logits_std=1e-4))
    assert noisy.failed
    first = noisy.figures["first_difference"]
    # the engine's first rollout is untouched; the trainer's first forward already differs
    assert first["iteration"] == 1 and first["field"] == "train log_prob_sum", first
    assert first["a"] != first["b"] and "iteration 1, train log_prob_sum, sample" in noisy.message

    _, greedy = run_repro_gate(cfg, AlignmentFaults(greedy_sampling=True))
    assert greedy.failed and "identical samples at temperature 1" in greedy.message, greedy.message
