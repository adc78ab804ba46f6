"""Replay and import of dumps shaped like slime's own (issue 17).

The dumps are written here from slime's documented `Sample` fields (slime/utils/types.py: group_index,
index, prompt, tokens, multimodal_*, response, response_length, label, reward, loss_mask,
weight_versions, rollout_log_probs, rollout_routed_experts, remove_sample, teacher_log_probs, status as
its enum's value string, metadata, spec_info, prefix_cache_info, ...), never with rollflow's own
`to_dict`, exactly as slime's `--save-debug-rollout-data` saves them:
`torch.save({"rollout_id": id, "samples": [sample.to_dict() ...]}, template.format(rollout_id=id))`,
eval rollouts under the id text `eval_{id}`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rollflow.artifacts import RolloutStore
from rollflow.flows.cli.tools import register

REPO = Path(__file__).resolve().parents[1]


def slime_sample(
    group: int,
    index: int,
    *,
    reward,
    status: str = "completed",
    prompt_ids=(3, 4, 5, 6),
    response_ids=(7, 8, 9),
    label: str = "12",
) -> dict:
    n = len(response_ids)
    return {
        "group_index": group,
        "index": index,
        "prompt": f"{group}+{index}=",
        "tokens": [*prompt_ids, *response_ids],
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "response": "".join(str(t) for t in response_ids),
        "response_length": n,
        "label": label,
        "reward": reward,
        "loss_mask": [1] * n,
        "weight_versions": ["2"],
        "rollout_log_probs": [-0.7] * n,
        "rollout_routed_experts": None,
        "remove_sample": False,
        "teacher_log_probs": [-0.6] * n,  # slime's on-policy distillation field: unknown to rollflow
        "mopd_teacher_log_probs": None,
        "status": status,
        "metadata": {"source": "test"},
        "generate_function_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {
            "spec_accept_token_num": 0,
            "spec_draft_token_num": 0,
            "spec_verify_ct": 0,
            "completion_token_num": n,
        },
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(prompt_ids)},
    }


def slime_rollout(rid: int, *, groups: int = 2, per_group: int = 4, bump: float = 0.0, bad_token: int | None = None):
    """A rollout's samples: dict rewards {acc, score}, one truncated sample per group."""
    samples = []
    for g in range(groups):
        for k in range(per_group):
            i = g * per_group + k
            acc = float((i + rid) % 2)
            response = (7, 8, bad_token) if bad_token is not None and i == 1 else (7, 8, 9)
            samples.append(
                slime_sample(
                    g,
                    i,
                    reward={"acc": acc, "score": 0.25 * k + bump},
                    status="truncated" if k == per_group - 1 else "completed",
                    response_ids=response,
                )
            )
    return samples


def save_dump(path: Path, rid, samples) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rid, "samples": samples}, str(path))


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256 (to prove nothing was written or lost)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()
    register(app)
    return app


def invoke(app, *args: str):
    return CliRunner().invoke(app, list(args))


# ----------------------------------------------------------------------------- content-addressed import


def test_import_is_content_addressed(tmp_path, app):
    dump = tmp_path / "dumps" / "data_0.pt"
    save_dump(dump, 0, slime_rollout(0))
    root = tmp_path / "store"
    res = invoke(app, "import-slime", str(dump), "--root", str(root), "--run", "r")
    assert res.exit_code == 0, res.output
    before = tree(root)
    # The same content again: a no-op that says so, nothing rewritten.
    res = invoke(app, "import-slime", str(dump), "--root", str(root), "--run", "r")
    assert res.exit_code == 0, res.output
    assert "same content: nothing written" in res.output
    assert tree(root) == before
    old_sha = hashlib.sha256(dump.read_bytes()).hexdigest()
    # Edited dump, same run and id: refused with both checksums, the store untouched.
    save_dump(dump, 0, slime_rollout(0, bump=1.0))
    new_sha = hashlib.sha256(dump.read_bytes()).hexdigest()
    res = invoke(app, "import-slime", str(dump), "--root", str(root), "--run", "r")
    assert res.exit_code == 2
    line = res.output.strip()
    assert old_sha in line and new_sha in line and "new run" in line and "\n" not in line
    assert tree(root) == before
    # Into a new run it imports.
    res = invoke(app, "import-slime", str(dump), "--root", str(root), "--run", "r2")
    assert res.exit_code == 0, res.output
    assert RolloutStore(str(root)).manifest("r2", "train", 0).extra["source_sha256"] == new_sha


def test_out_of_vocab_token_refused_at_import(tmp_path, app):
    dump = tmp_path / "data_3.pt"
    save_dump(dump, 3, slime_rollout(3, bad_token=99))
    root = tmp_path / "store"
    res = invoke(app, "import-slime", str(dump), "--root", str(root), "--run", "r", "--vocab-size", "15")
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line
    assert "rollout 3, sample 1" in line and "token id 99" in line and "vocab size 15" in line
    assert not root.exists() or tree(root) == {}


def test_check_token_ids_one_line():
    from rollflow.artifacts.slime import TokenOutOfVocab, check_token_ids, slime_dict_to_sample

    samples = [slime_dict_to_sample(d, position=i) for i, d in enumerate(slime_rollout(5, bad_token=40))]
    with pytest.raises(TokenOutOfVocab) as info:
        check_token_ids(samples, 15, rollout_id=5)
    assert "train rollout 5, sample 1" in str(info.value) and "token id 40" in str(info.value)
    check_token_ids(samples, 64, rollout_id=5)  # in range: nothing


# ----------------------------------------------------------------------------- dict rewards with the run's key


def test_show_and_replay_reward_honour_run_level_reward_keys(tmp_path, app):
    template = str(tmp_path / "dumps" / "data_{rollout_id}.pt")
    save_dump(Path(template.format(rollout_id=0)), 0, slime_rollout(0))
    save_dump(Path(template.format(rollout_id="eval_0")), "eval_0", slime_rollout(0, bump=0.5))

    # Train split: --reward-key picks `acc` (half the samples are 1.0).
    res = invoke(app, "show", template, "--id", "0", "--split", "train", "--reward-key", "acc", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ids"] == {"train": [0], "eval": [0]}  # the eval dump is discovered too
    assert doc["metrics"]["reward_mean"] == pytest.approx(0.5)
    # Without a key slime's dict rewards have no scalar value: none are counted as scored.
    doc = json.loads(invoke(app, "show", template, "--id", "0", "--split", "train", "--json").stdout)
    assert doc["metrics"]["n_scored"] == 0
    # Eval split: --eval-reward-key wins over --reward-key (as slime's --eval-reward-key).
    res = invoke(
        app,
        "show",
        template,
        "--split",
        "eval",
        "--id",
        "0",
        "--reward-key",
        "acc",
        "--eval-reward-key",
        "score",
        "--json",
    )
    doc = json.loads(res.stdout)
    assert doc["metrics"]["reward_mean"] == pytest.approx(0.5 + 0.25 * 1.5)

    # replay-reward compares the stored `acc` with a function returning {acc, ...}: nothing changed.
    res = invoke(
        app,
        "replay-reward",
        template,
        "--id",
        "0",
        "--split",
        "train",
        "--reward",
        "tests.test_slime_replay:same_acc",
        "--reward-key",
        "acc",
        "--json",
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n_changed"] == 0


def same_acc(sample) -> dict:
    """A reward function that recomputes slime's `acc` of `slime_rollout(0)` from the sample index."""
    return {"acc": float(sample.index % 2), "other": 3.0}


def test_eval_summary_and_scalar_reward_use_given_key():
    from rollflow.artifacts.slime import slime_dict_to_sample
    from rollflow.tasks.rollout.evaluation import eval_summary

    samples = [slime_dict_to_sample(d, position=i) for i, d in enumerate(slime_rollout(0))]
    assert eval_summary(samples, reward_key="score")["eval/accuracy"] == pytest.approx(0.375)
    with pytest.raises(ValueError, match="rollout.reward_key"):
        samples[0].scalar_reward()
    assert samples[1].scalar_reward("acc") == 1.0


# ----------------------------------------------------------------------------- export-slime exits cleanly


def test_parquet_reads_hand_arrow_owned_memory(monkeypatch):
    """The cause of export-slime's rc 134: Arrow pool threads releasing Python-owned buffers at exit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollflow.artifacts import codec

    seen = {}
    real = pq.read_table

    def spy(source, **kwargs):
        seen.update(kwargs, source=source)
        return real(source, **kwargs)

    monkeypatch.setattr(codec.pq, "read_table", spy)
    data = codec.samples_to_parquet_bytes(
        [__import__("rollflow.artifacts.slime", fromlist=["x"]).slime_dict_to_sample(slime_sample(0, 0, reward=1.0))]
    )
    codec.samples_from_parquet_bytes(data)
    assert seen["pre_buffer"] is False
    assert isinstance(seen["source"], pa.BufferReader)
    assert codec._arrow_owned(data).to_pybytes() == data


def test_export_slime_exits_zero_in_subprocesses(tmp_path):
    """`rollflow export-slime` in fresh interpreters: rc 0 and no abort message, every time."""
    from rollflow.artifacts.slime import slime_dict_to_sample

    store = RolloutStore(str(tmp_path / "store"))
    from rollflow.artifacts import EngineInfo

    samples = [slime_dict_to_sample(d, position=i) for i, d in enumerate(slime_rollout(0))]
    for rid in range(3):
        store.write(
            "src",
            "train",
            rid,
            samples,
            n_samples_per_prompt=4,
            engine=EngineInfo(backend="slime", model="m", weight_version=0),
            config_hash="c",
        )
    exe = str(Path(sys.executable).with_name("rollflow"))
    runs = int(os.environ.get("ROLLFLOW_EXPORT_RUNS", "4"))
    for n in range(runs):
        out = tmp_path / f"out{n}"
        proc = subprocess.run(
            [exe, "export-slime", str(tmp_path / "store" / "src"), f"{out}/d_{{rollout_id}}.pt", "--all"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "terminate called" not in proc.stderr
        assert sorted(p.name for p in out.iterdir()) == ["d_0.pt", "d_1.pt", "d_2.pt"]


# ----------------------------------------------------------------------------- replay through the flow


@pytest.mark.slow
def test_replay_slime_dict_rewards_eval_and_changed_dump(tmp_path, prefect_api, ray_local):
    from rollflow.artifacts.slime import SlimeImportConflict
    from rollflow.flows.debug import replay_train
    from tests.conftest import small_config

    template = str(tmp_path / "dumps" / "data_{rollout_id}.pt")
    for rid in (0, 1):
        save_dump(Path(template.format(rollout_id=rid)), rid, slime_rollout(rid))
    save_dump(Path(template.format(rollout_id="eval_0")), "eval_0", slime_rollout(0, bump=0.5))
    root = tmp_path / "store"
    cfg = small_config(
        root,
        run="sr",
        eval_every=1,
        rollout={"n_samples_per_prompt": 4, "reward_key": "acc", "eval_reward_key": "score"},
        train={"num_steps_per_rollout": 1, "micro_batch_size": 64},
        data={"prompts_per_rollout": 2, "eval_prompts": 2},
        debug={"load_debug_rollout_data": template},
    )
    out = replay_train(cfg)
    assert [s["rollout_id"] for s in out["steps"]] == [0, 1] and out["eval_ids"] == [0]
    first = out["steps"][0]
    assert first["rollout/raw_reward"] == pytest.approx(0.5)  # `acc`: half the samples
    assert first["eval/accuracy"] == pytest.approx(0.5 + 0.375)  # eval uses `score`
    assert "eval/accuracy" not in out["steps"][1]  # no eval dump for rollout 1
    store = RolloutStore(str(root))
    assert store.list_ids("sr", "eval") == [0]
    assert store.load("sr", "train", 0).samples[0].metadata["extra_fields"]["teacher_log_probs"] == [-0.6] * 3

    # An edited dump under the same run name: refused with both checksums, nothing written or lost.
    old_sha = hashlib.sha256(Path(template.format(rollout_id=1)).read_bytes()).hexdigest()
    save_dump(Path(template.format(rollout_id=1)), 1, slime_rollout(1, bump=2.0))
    new_sha = hashlib.sha256(Path(template.format(rollout_id=1)).read_bytes()).hexdigest()
    before = tree(root)
    with pytest.raises(SlimeImportConflict) as info:
        replay_train(cfg)
    assert old_sha in str(info.value) and new_sha in str(info.value) and "--import-run" in str(info.value)
    after = tree(root)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [k for k in after if k not in before and "/rollouts/" in k]
    # The explicit way out: a new run for the changed dumps.
    out = replay_train(cfg, import_run="sr-v2")
    assert [s["rollout_id"] for s in out["steps"]] == [0, 1]
    assert store.manifest("sr-v2", "train", 1).extra["source_sha256"] == new_sha


@pytest.mark.slow
def test_replay_checks_every_pinned_checksum_before_training(tmp_path, prefect_api, ray_local):
    from rollflow.artifacts import EngineInfo
    from rollflow.artifacts.errors import ArtifactCorrupt
    from rollflow.artifacts.slime import slime_dict_to_sample
    from rollflow.flows.debug import replay_train
    from tests.conftest import small_config

    root = tmp_path / "store"
    store = RolloutStore(str(root))
    for rid in (0, 1):
        samples = [slime_dict_to_sample(d, position=i) for i, d in enumerate(slime_rollout(rid))]
        for s in samples:
            s.reward = s.reward["acc"]
        store.write(
            "src",
            "train",
            rid,
            samples,
            n_samples_per_prompt=4,
            engine=EngineInfo(backend="slime", model="m", weight_version=0),
            config_hash="c",
        )
    payload = root / "src" / "rollouts" / "train" / "000001" / "samples.parquet"
    payload.write_bytes(payload.read_bytes()[:-10] + b"0123456789")
    cfg = small_config(root, run="rp", data={"prompts_per_rollout": 2, "eval_prompts": 2}, debug={"train_only": True})
    with pytest.raises(ArtifactCorrupt) as info:
        replay_train(cfg, source_run="src")
    assert "000001" in str(info.value)
    assert not (root / "rp").exists()  # rollout 0 was not trained: no replay state, no metrics
