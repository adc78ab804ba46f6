"""RunConfig validation: every rule's message names the field(s) and the fix."""

from __future__ import annotations

import pytest

from rollflow.flows.config_loading import ConfigError, load_config


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_defaults_validate():
    cfg = load_config(None, [])
    assert cfg.rollout.engine == "hf" and cfg.train.backend == "torch" and cfg.notices == []


def test_unknown_field_named():
    msg = error_of("trian.lr=1e-4")
    assert "trian" in msg and "unknown field" in msg


def test_nested_unknown_field_named():
    assert "train.learning_rate" in error_of("train.learning_rate=1e-4")


def test_negative_batch_size_named():
    msg = error_of("data.prompts_per_rollout=-4")
    assert "data.prompts_per_rollout" in msg and "greater than or equal to 1" in msg


def test_kl_penalty_and_kl_loss_exclusive():
    msg = error_of("algo.kl_coef=0.1", "algo.kl_loss_coef=0.1")
    assert "algo.kl_coef" in msg and "algo.kl_loss_coef" in msg and "not both" in msg


def test_gamma_only_for_reinforce_pp():
    msg = error_of("algo.gamma=0.9")
    assert "algo.gamma" in msg and "reinforce_plus_plus" in msg
    load_config(None, ["algo.gamma=0.9", "algo.advantage_estimator=reinforce_plus_plus"])


def test_dual_clip_must_exceed_one():
    assert "algo.eps_clip_c" in error_of("algo.eps_clip_c=0.5")


def test_rollout_only_with_train_only_names_both():
    msg = error_of("debug.rollout_only=true", "debug.train_only=true")
    assert "debug.rollout_only" in msg and "debug.train_only" in msg


def test_load_debug_rollout_data_implies_train_only():
    cfg = load_config(None, ["debug.load_debug_rollout_data=/d/data_{rollout_id}.pt"])
    assert cfg.debug.train_only is True
    assert any("debug.train_only turned on" in n for n in cfg.notices)


def test_load_debug_rollout_data_with_rollout_only_rejected():
    msg = error_of("debug.load_debug_rollout_data=/d/data_{rollout_id}.pt", "debug.rollout_only=true")
    assert "debug.load_debug_rollout_data" in msg and "debug.rollout_only" in msg


def test_rollout_only_turns_off_colocation_and_offload_with_notice():
    cfg = load_config(None, ["debug.rollout_only=true", "placement=colocate", "offload=true"])
    assert cfg.placement == "disaggregated" and cfg.offload is False
    assert any("placement" in n and "offload" in n for n in cfg.notices)


@pytest.mark.parametrize("field", ["debug.save_debug_rollout_data", "debug.load_debug_rollout_data"])
def test_template_without_placeholder(field):
    msg = error_of(f"{field}=/d/data.pt")
    assert field in msg and "{rollout_id}" in msg


def test_subsample_needs_replay():
    msg = error_of("debug.load_debug_rollout_data_subsample=0.5")
    assert "debug.load_debug_rollout_data_subsample" in msg


def test_offload_needs_colocate():
    assert "placement='colocate'" in error_of("offload=true")


def test_bad_run_name():
    assert "run=" in error_of("run=a/b")


def test_bad_override_syntax():
    assert "key=value" in error_of("train.lr")


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


def test_steps_cannot_exceed_samples():
    msg = error_of("data.prompts_per_rollout=1", "rollout.n_samples_per_prompt=2", "train.num_steps_per_rollout=4")
    assert "train.num_steps_per_rollout" in msg


def test_cli_prints_config_error(tmp_path):
    from typer.testing import CliRunner

    from rollflow.flows.cli import app

    result = CliRunner().invoke(app, ["config", "--set", "algo.kl_coef=0.1", "--set", "algo.kl_loss_coef=0.1"])
    assert result.exit_code == 2
    assert "not both" in result.output


def test_gspo_takes_the_papers_clip_ranges_and_sequence_mean_with_a_notice():
    cfg = load_config(None, ["algo.advantage_estimator=gspo"])
    algo = cfg.algo
    assert (algo.eps_clip, algo.eps_clip_high, algo.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    [notice] = [n for n in cfg.notices if "gspo" in n]
    assert "algo.eps_clip=0.0003" in notice and "algo.eps_clip_high=0.0004" in notice
    assert "seq-mean-token-mean" in notice
    # the dumped config (deployments, replays) keeps the values and needs no second notice
    again = type(cfg).model_validate(cfg.model_dump())
    assert again.algo.model_dump() == algo.model_dump() and again.notices == []
    # grpo keeps its own defaults
    grpo = load_config(None, []).algo
    assert (grpo.eps_clip, grpo.eps_clip_high, grpo.loss_agg_mode) == (0.2, None, "token-mean")


def test_gspo_keeps_what_the_user_set():
    sets = ["algo.eps_clip=0.2", "algo.eps_clip_high=0.28", "algo.loss_agg_mode=token-mean"]
    explicit = load_config(None, ["algo.advantage_estimator=gspo", *sets])
    algo = explicit.algo
    assert (algo.eps_clip, algo.eps_clip_high, algo.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not [n for n in explicit.notices if "gspo" in n]
    # eps_clip alone is a symmetric range the user chose: eps_clip_high stays "= eps_clip"
    low_only = load_config(None, ["algo.advantage_estimator=gspo", "algo.eps_clip=1e-3"])
    assert (low_only.algo.eps_clip, low_only.algo.eps_clip_high) == (1e-3, None)
    [notice] = [n for n in low_only.notices if "gspo" in n]
    assert "loss_agg_mode" in notice and "eps_clip" not in notice
