"""The alignment checks on plain workers (no Prefect server, no Ray): the default passes, and every
injected fault fails exactly the check that guards against it, with the cause named."""

from __future__ import annotations

import json

import pytest

from rollflow.artifacts.sample import Sample
from rollflow.tasks.debug.alignment import CHECK_NAMES, alignment_workers, run_alignment, run_alignment_local
from rollflow.tasks.debug.checks import AlignmentReport, AlignmentThresholds, CheckResult, worst
from rollflow.tasks.debug.coherence import printable_units, repetition_fraction
from rollflow.tasks.debug.faults import AlignmentFaults
from rollflow.tasks.model.tokenizer import CharTokenizer
from tests.conftest import small_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return small_config(tmp_path_factory.mktemp("align"), run="align")


@pytest.fixture(scope="module")
def default_report(cfg):
    return run_alignment_local(cfg)


def test_default_model_passes_every_check(default_report):
    report = default_report
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert report.status == "pass", report.to_markdown()
    coherence = report.check("coherence").figures
    assert coherence["printable_ratio"] > 0.99 and coherence["format_fraction"] > 0.9
    assert coherence["repetition_fraction"] < 0.05 and coherence["ref_nll"] < 1.0
    ref = report.check("step1_logprob_equals_ref").figures
    assert ref["equal"] is True and ref["kl_mean"] == 0.0 and ref["max_abs_diff"] == 0.0
    mm = report.check("train_rollout_logprob_diff").figures
    assert mm["mean_abs_diff"] < 1e-5 and mm["max_abs_diff"] < 1e-4
    assert len(mm["worst_samples"]) == 5 and mm["worst_samples"][0]["max_abs_diff"] == mm["max_abs_diff"]
    step = report.check("one_step_update").figures
    assert step["ppo_kl"] == 0.0 and step["pg_clipfrac"] == 0.0 and 0 < step["grad_norm"] < 10
    sync = report.check("weight_sync_parity").figures
    assert sync["n_mismatched"] == 0 and sync["n_tensors"] > 20 and sync["weight_version"] == 1
    step2 = report.check("step2_load_and_memory").figures
    assert step2["engine_weight_version"] == 1 and step2["sample_weight_versions"] == [1]
    assert step2["peak_mb"] > 50 and step2["memory_budget_mb"] is None
    assert all(not c.causes for c in report.checks)  # causes only accompany a warn or a fail


def test_report_renders_markdown_json_and_table(default_report):
    md = default_report.to_markdown()
    assert "**Result: PASS**" in md
    for name in CHECK_NAMES:
        assert f"{name}: PASS" in md
    data = json.loads(default_report.to_json())
    assert data["status"] == "pass" and data["counts"] == {"pass": 7, "warn": 0, "fail": 0}
    again = AlignmentReport.from_dict(data)
    assert [c.status for c in again.checks] == ["pass"] * 7
    rows = default_report.table_rows()
    assert [r["check"] for r in rows] == list(CHECK_NAMES) and all(r["status"] == "pass" for r in rows)


FAULTS = [
    pytest.param(
        dict(faults=AlignmentFaults(gibberish_weights="shuffle")),
        "coherence",
        ["repetition_fraction", "format_fraction"],
        "checkpoint not loaded",
        id="gibberish-shuffled",
    ),
    pytest.param(
        dict(faults=AlignmentFaults(gibberish_weights="random")),
        "coherence",
        ["ref_nll", "format_fraction"],
        "parameter names not mapped",
        id="gibberish-random",
    ),
    pytest.param(
        dict(faults=AlignmentFaults(perturb_ref_std=1e-3)),
        "step1_logprob_equals_ref",
        ["log_probs != ref_log_probs"],
        "non-deterministic kernels",
        id="perturbed-ref",
    ),
    # a wrong engine temperature moves the whole distribution: both the per-token diff and the KL fail
    pytest.param(
        dict(faults=AlignmentFaults(engine_temperature=0.7)),
        ("train_rollout_logprob_diff", "train_rollout_kl"),
        ["mean |train - rollout|"],
        "temperature applied differently",
        id="engine-temperature",
    ),
    pytest.param(
        dict(faults=AlignmentFaults(perturb_policy_std=1e-3)),
        "one_step_update",
        ["ppo_kl", "!= 0"],
        "policy changed between computing the old log-probs",
        id="policy-moved",
    ),
    pytest.param(
        dict(faults=AlignmentFaults(sync="corrupt_tensor")),
        "weight_sync_parity",
        ["first mismatching tensor: model.layers.1.input_layernorm.weight"],
        "corrupted or cast in transit",
        id="sync-corrupt",
    ),
    pytest.param(
        dict(faults=AlignmentFaults(sync="swap_layers")),
        "weight_sync_parity",
        ["first mismatching tensor: model.layers.0."],
        "layers swapped",
        id="sync-swap",
    ),
    pytest.param(
        dict(memory_budget_mb=1.0),
        "step2_load_and_memory",
        ["above the budget of 1 MB"],
        "lower train.micro_batch_size",
        id="memory-budget",
    ),
]


@pytest.mark.parametrize("kwargs, failing, message_parts, cause", FAULTS)
def test_fault_fails_exactly_its_check(cfg, kwargs, failing, message_parts, cause):
    report = run_alignment_local(cfg, **kwargs)
    statuses = {c.name: c.status for c in report.checks}
    failing, *also = (failing,) if isinstance(failing, str) else failing
    assert [c.name for c in report.failed] == [failing, *also], report.summary()
    check = report.check(failing)
    for part in message_parts:
        assert part in check.message, check.message
    assert any(cause in c for c in check.causes), check.causes
    md = report.to_markdown()
    assert "**Result: FAIL**" in md and "Likely causes:" in md and cause in md
    if "faults" in kwargs:
        assert report.context["faults"] == kwargs["faults"].describe()
        assert "Injected faults" in md
    # The other checks do not fail (random weights may warn about the log-prob level: also gibberish).
    assert all(s != "fail" for n, s in statuses.items() if n not in (failing, *also))


def test_wrong_name_mapping_is_named(cfg):
    """A pipeline-stage layer offset applied twice: the report names the first unmapped tensor."""
    rollout, trainer = alignment_workers(cfg)

    def bad_map(name: str) -> str:
        return name.replace("layers.1.", "layers.3.")

    report = run_alignment(rollout, trainer.backend, cfg, name_map=bad_map)  # a bare TrainBackend works too
    sync = report.check("weight_sync_parity")
    assert sync.failed and "model.layers.3." in sync.message
    assert any("second pipeline stage" in c for c in sync.causes)
    assert [c.name for c in report.failed] == ["weight_sync_parity"]


def test_bfloat16_engine_warns_on_mismatch_and_syncs_in_its_dtype(tmp_path):
    """A real precision difference: bf16 engine, fp32 trainer. The weights arrive (compared in the engine's
    dtype), the log-probs differ by bf16 rounding: a warning with its causes, nothing fails."""
    bf16 = small_config(tmp_path, run="bf16", rollout={"dtype": "bfloat16"})
    report = run_alignment_local(bf16)
    assert not report.failed, report.summary()
    mm = report.check("train_rollout_logprob_diff")
    assert mm.status == "warn" and 1e-4 < mm.figures["mean_abs_diff"] < 1e-2
    assert any("dtype" in c for c in mm.causes)
    sync = report.check("weight_sync_parity")
    assert sync.passed and sync.figures["compared_in"] == "bfloat16"
    kl = report.check("train_rollout_kl")
    assert kl.status in ("pass", "warn") and 0 < kl.figures["k3_kl"] < 1e-3
    for key in ("kl", "log_ppl_diff", "ppl_ratio", "chi2_token", "chi2_seq", "ess_token", "tis", "training_log_ppl"):
        assert key in kl.figures, key
    assert "train_rollout_kl" in report.to_markdown() and "k3_kl" in report.to_markdown()
    # the nightly check's KL limit is a threshold: the same precision gap fails once the limit is below it
    strict = run_alignment_local(bf16, thresholds=AlignmentThresholds(mismatch_kl_fail=kl.figures["k3_kl"] / 2))
    assert [c.name for c in strict.failed] == ["train_rollout_kl"], strict.summary()
    assert "limit" in strict.check("train_rollout_kl").message


def test_a_raising_phase_becomes_a_failed_check(cfg):
    """The weight update raises (here: a fault naming a tensor that does not exist): check 5 fails with
    the error, check 6 sees the engine still at version 0; the run still ends with a full report."""
    report = run_alignment_local(cfg, faults=AlignmentFaults(sync="corrupt_tensor", sync_tensor="no.such.weight"))
    sync, step2 = report.check("weight_sync_parity"), report.check("step2_load_and_memory")
    assert sync.failed and "weight update raised: KeyError" in sync.message and "no.such.weight" in sync.message
    assert step2.failed and "engine at weight_version 0" in step2.message
    assert [c.status for c in report.checks[:4]] == ["pass"] * 4


def test_thresholds_are_configurable(cfg):
    tight = AlignmentThresholds(max_grad_norm=1e-6, mismatch_mean_warn=0.0)
    report = run_alignment_local(cfg, thresholds=tight)
    assert report.check("one_step_update").failed and "grad_norm" in report.check("one_step_update").message
    assert report.check("train_rollout_logprob_diff").status == "warn"


def test_coherence_figures_by_hand():
    assert repetition_fraction([5, 5, 5, 5, 5]) == pytest.approx(0.75)
    assert repetition_fraction([3, 4, 5, 6]) == 0.0 and repetition_fraction([7]) == 0.0
    tok = CharTokenizer(alphabet="0123456789+=", vocab_size=15)
    prompt = [1, *tok.encode("12+34=")]

    def sample(resp: list[int], status: str = "completed") -> Sample:
        return Sample(
            group_index=0,
            index=0,
            prompt="12+34=",
            tokens=prompt + resp,
            response=tok.decode(resp),
            response_length=len(resp),
            loss_mask=[1] * len(resp),
            rollout_log_probs=[0.0] * len(resp),
            status=status,
        )

    assert printable_units(tok, sample([*tok.encode("046"), 2])) == (3, 3)  # final EOS not counted
    assert printable_units(tok, sample([*tok.encode("04"), 1, 0, 2])) == (2, 4)  # stray BOS / PAD count against
    # Ids outside the alphabet decode to U+FFFD: not printable.
    assert printable_units(tok, sample([*tok.encode("0"), 20, 21], status="truncated")) == (1, 3)


def test_check_result_contract():
    with pytest.raises(ValueError):
        CheckResult("x", "ok", {}, "")  # type: ignore[arg-type]
    assert worst("pass", "warn") == "warn" and worst("warn", "fail", "pass") == "fail" and worst() == "pass"
    report = AlignmentReport([CheckResult("a", "pass", {"v": float("nan")}, "m")])
    assert json.loads(report.to_json())["checks"][0]["figures"]["v"] == "nan"


def test_cli_align_local(cfg, tmp_path):
    import typer
    from typer.testing import CliRunner

    from rollflow.flows.cli.align import register

    app = typer.Typer()
    register(app)
    sets = ["run=cli", f"store.root={tmp_path}", "data.prompts_per_rollout=16", "rollout.n_samples_per_prompt=4"]
    args = ["align", "--local"] + [x for s in sets for x in ("--set", s)]
    ok = CliRunner().invoke(app, args + ["--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["status"] == "pass" and (tmp_path / "cli" / "alignment").is_dir()
    assert json.loads(open(data["json_path"]).read())["status"] == "pass"
    bad = CliRunner().invoke(app, args + ["--memory-budget-mb", "1"])
    assert bad.exit_code == 1
    assert "**Result: FAIL**" in bad.output and "step2_load_and_memory: FAIL" in bad.output


def test_a_ppo_run_is_checked_with_grpo_advantages(tmp_path):
    """ppo's advantages come from a critic actor the checks do not start; precision does not depend on them."""
    ppo = small_config(tmp_path, run="ppo", algo={"advantage_estimator": "ppo"})
    report = run_alignment_local(ppo)
    assert report.ok, report.summary()
    assert report.context["advantage_estimator"].startswith("grpo")
    assert report.check("one_step_update").figures["ppo_kl"] == 0.0


def test_alignment_workers_read_the_runs_compile_cache(tmp_path, caplog):
    """`rollflow align --local` builds its workers as the run's are built: with store.compile_cache set, each
    loads its role's file before compiling (here unreadable bytes, so each load is a logged miss naming its file)."""
    from pathlib import Path

    from rollflow.tasks.compile_cache import cache_file

    uri = str(tmp_path / "cc")
    cfg = small_config(tmp_path, run="align-cc", store={"root": str(tmp_path), "compile_cache": uri})
    for role in ("engine", "trainer"):
        path = Path(cache_file(uri, role))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a cache")
    alignment_workers(cfg)
    for role in ("engine", "trainer"):
        assert f"compile cache {cache_file(uri, role)} not loaded" in caplog.text, caplog.text
