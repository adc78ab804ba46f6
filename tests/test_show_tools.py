"""`rollflow show / replay-reward / send` on real artifacts (and the real tiny model for send)."""

from __future__ import annotations

import json
import random
import time

import pytest
import typer
from typer.testing import CliRunner

from rollflow.artifacts import EngineInfo, RolloutStore, Sample, Status
from rollflow.flows.cli.tools import register
from rollflow.tasks.debug.display import (
    SampleTable,
    discover,
    filter_samples,
    load_sample_table,
    render_table,
    rollout_metrics,
    select_rollout,
)
from rollflow.tasks.debug.replay_reward import replay_reward

ENGINE = EngineInfo(backend="hf", model="builtin:addition", weight_version=0)


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()
    register(app)
    return app


def invoke(app, *args: str):
    # a fixed width: rich sizes tables to the terminal, which differs between a shell, CI and pytest-xdist workers
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "160"})


def sample(
    group: int,
    index: int,
    response_tokens: list[int],
    reward,
    status=Status.COMPLETED,
    *,
    response: str = "",
    label: str | None = "0357",
    prompt_tokens=(1, 3, 4, 5),
) -> Sample:
    return Sample(
        group_index=group,
        index=index,
        prompt=f"p{group}",
        tokens=list(prompt_tokens) + response_tokens,
        response=response or f"r{index}",
        response_length=len(response_tokens),
        loss_mask=[1] * len(response_tokens),
        rollout_log_probs=[-0.1] * len(response_tokens),
        reward=reward,
        label=label,
        status=status,
        metadata={"i": index},
    )


def hand_built() -> list[Sample]:
    """Known metrics: see test_metrics_on_hand_built_artifact."""
    rep = [5, 6, 7, 5, 6, 7, 5, 6, 7]  # the 3-gram (5,6,7) three times: repetitive
    twice = [5, 6, 7, 5, 6, 7]  # only twice: not repetitive
    same = [9, 9, 9, 9, 9]  # (9,9,9) at 3 overlapping positions: repetitive
    T = Status.TRUNCATED
    return [
        # group 0: all rewards 1 -> zero std
        sample(0, 0, rep, 1.0, T),
        sample(0, 1, [4, 4], 1.0),
        sample(0, 2, [4], 1.0),
        sample(0, 3, [4, 5, 6], 1.0),
        # group 1: mixed rewards
        sample(1, 4, twice, 0.0),
        sample(1, 5, [8, 8], 1.0, T),
        sample(1, 6, [6, 7], 0.0),
        sample(1, 7, same, 1.0),
        # group 2: two equal scored rewards and an unscored sample -> zero std
        sample(2, 8, [3, 3, 3], 0.0, Status.ABORTED),
        sample(2, 9, [3], 0.0),
        sample(2, 10, [3, 4], None),
        # group 3: a single scored sample -> no std to speak of
        sample(3, 11, [7, 7, 5, 6], 0.5, Status.FAILED),
    ]


def write(store: RolloutStore, run: str, rollout_id: int, samples, split: str = "train", per_prompt: int = 4):
    return store.write(
        run, split, rollout_id, samples, n_samples_per_prompt=per_prompt, engine=ENGINE, config_hash="test"
    )


@pytest.fixture
def hand_store(tmp_path):
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "hand", 0, hand_built()[:4])
    write(store, "hand", 3, hand_built())
    write(store, "hand", 0, hand_built()[4:8], split="eval")
    return store


# ----------------------------------------------------------------------------- metrics and filters


def test_metrics_on_hand_built_artifact(hand_store):
    expected_rewards = [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0.5]
    mean = sum(expected_rewards) / 11
    std = (sum((r - mean) ** 2 for r in expected_rewards) / 11) ** 0.5
    lengths = [9, 2, 1, 3, 6, 2, 2, 5, 3, 1, 2, 4]
    table = load_sample_table(hand_store, "hand", "train", 3)
    for samples in (hand_built(), table):  # the list path and the columnar path agree
        m = rollout_metrics(samples)
        assert m["n_samples"] == 12 and m["n_groups"] == 4
        assert m["response_len_mean"] == pytest.approx(sum(lengths) / 12)
        assert (m["response_len_min"], m["response_len_max"]) == (1, 9)
        assert m["truncated_ratio"] == pytest.approx(2 / 12)
        assert m["n_scored"] == 11
        assert m["reward_mean"] == pytest.approx(mean) and m["reward_std"] == pytest.approx(std)
        assert (m["reward_min"], m["reward_max"]) == (0.0, 1.0)
        assert m["zero_std_groups"] == 2 and m["zero_std_group_fraction"] == pytest.approx(2 / 3)
        assert m["repetition_fraction"] == pytest.approx(2 / 12)
        assert m["status_counts"] == {"completed": 8, "truncated": 2, "aborted": 1, "failed": 1}
    assert rollout_metrics([])["reward_mean"] is None


def test_repetition_ignores_prompt_and_response_boundaries():
    # (5,6,7) twice at the end of one response plus once at the start of the next: not repetitive.
    a = sample(0, 0, [1, 5, 6, 7, 5, 6, 7, 5, 6], 1.0, prompt_tokens=(5, 6, 7, 5, 6, 7))
    b = sample(0, 1, [7, 2], 1.0)
    assert rollout_metrics([a, b])["repetition_fraction"] == 0.0


def test_filters_and_lazy_table(hand_store):
    table = load_sample_table(hand_store, "hand", "train", 3)
    assert isinstance(table, SampleTable) and len(table) == 12
    assert table[5] == hand_built()[5] and table[-1] == hand_built()[-1] and list(table) == hand_built()
    truncated = filter_samples(table, status="Status.TRUNCATED")
    assert isinstance(truncated, SampleTable) and [s.index for s in truncated] == [0, 5]
    assert truncated.rows.tolist() == [0, 5]
    ranged = filter_samples(hand_built(), reward_min=0.25, reward_max=0.75)
    assert [s.index for s in ranged] == [11]
    assert [s.index for s in filter_samples(table, reward_max=0.0)] == [4, 6, 8, 9]  # unscored dropped
    assert render_table(truncated, 1, 1, json_mode=True) == json.dumps(
        [{"row": 5, **hand_built()[5].to_dict()}], ensure_ascii=False
    )
    with pytest.raises(ValueError, match="unknown status"):
        filter_samples(table, status="done")


def test_discover_spellings_and_selection(hand_store, tmp_path):
    run_uri = str(tmp_path / "runs" / "hand")
    found = discover(run_uri)
    assert [(f.split, f.rollout_id) for f in found] == [("train", 0), ("train", 3), ("eval", 0)]
    assert select_rollout(found).rollout_id == 3
    assert select_rollout(found, "eval").split == "eval"
    one = discover(hand_store.artifact_uri("hand", "train", 3))
    assert len(one) == 1 and one[0].loader() == hand_built()
    for suffix in ("/manifest.json", "/samples.parquet"):
        assert discover(hand_store.artifact_uri("hand", "train", 3) + suffix)[0].rollout_id == 3
    with pytest.raises(FileNotFoundError, match="committed train rollout ids of run 'hand': 0, 3"):
        discover(hand_store.artifact_uri("hand", "train", 5))
    assert [(f.split, f.rollout_id) for f in discover(run_uri + "/rollouts/eval")] == [("eval", 0)]
    with pytest.raises(FileNotFoundError, match="looks like a store root; runs there: hand"):
        discover(str(tmp_path / "runs"))
    with pytest.raises(FileNotFoundError, match="runs under .*: hand"):
        discover(str(tmp_path / "runs" / "hnad"))


# ----------------------------------------------------------------------------- show CLI


def test_show_text_json_and_filters(app, hand_store, tmp_path):
    run_uri = str(tmp_path / "runs" / "hand")
    res = invoke(app, "show", run_uri)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "train: 0, 3 (2); eval: 0 (1)" in out and "showing train rollout 3" in out
    assert "zero_std_groups" in out and "repetition_fraction" in out and "samples 1-12 of 12" in out
    assert "truncated" in out and "r11" in out

    res = invoke(app, "show", run_uri, "--status", "truncated", "--reward-min", "1", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ids"] == {"train": [0, 3], "eval": [0]} and (doc["split"], doc["rollout_id"]) == ("train", 3)
    assert doc["metrics"]["n_samples"] == 12 and doc["n_matching"] == 2
    assert [(s["row"], s["index"], s["status"]) for s in doc["samples"]] == [(0, 0, "truncated"), (5, 5, "truncated")]

    res = invoke(app, "show", run_uri, "--reward-max", "0", "--limit", "2", "--offset", "1", "--json")
    doc = json.loads(res.stdout)
    assert doc["n_matching"] == 4 and [s["index"] for s in doc["samples"]] == [6, 8]

    res = invoke(app, "show", run_uri, "--split", "eval", "--json")
    assert json.loads(res.stdout)["metrics"]["n_samples"] == 4

    res = invoke(app, "show", run_uri, "--limit", "3", "--max-chars", "8")
    assert "next page: --offset 3" in res.output


def test_show_prints_sample_text_verbatim(app, tmp_path):
    store = RolloutStore(str(tmp_path / "runs"))
    tricky = sample(0, 0, [4, 5], 1.0, response="[/]x[bold]y", label="[red]")
    write(store, "m", 0, [tricky], per_prompt=1)
    res = invoke(app, "show", str(tmp_path / "runs" / "m"))
    assert res.exit_code == 0, res.output
    assert "[/]x[bold]y" in res.output and "[red]" in res.output


def test_show_errors_name_the_argument(app, hand_store, tmp_path):
    run_uri = str(tmp_path / "runs" / "hand")
    res = invoke(app, "show", run_uri, "--id", "7")
    assert res.exit_code == 2
    assert "--id 7" in res.output and "existing ids: train: 0, 3 (2); eval: 0 (1)" in res.output
    res = invoke(app, "show", run_uri, "--split", "eval", "--id", "3")
    assert res.exit_code == 2 and "existing ids: eval: 0 (1)" in res.output
    res = invoke(app, "show", run_uri, "--status", "done")
    assert res.exit_code == 2 and "--status 'done'" in res.output
    res = invoke(app, "show", str(tmp_path / "nowhere" / "run"))
    assert res.exit_code == 2 and "ARTIFACT_URI" in res.output and "no committed rollouts" in res.output
    res = invoke(app, "show", str(tmp_path / "d" / "x_{rollout_id}.pt"))
    assert res.exit_code == 2 and "no file matches the slime template" in res.output


def test_show_first_page_of_10000_samples_under_3s(app, tmp_path):
    rng = random.Random(0)
    samples = []
    for i in range(10_000):
        response = [rng.randrange(3, 15) for _ in range(48)]
        samples.append(
            Sample(
                group_index=i // 8,
                index=i,
                prompt=f"{i % 1000:03d}+{(7 * i) % 1000:03d}=",
                tokens=[1] + [rng.randrange(3, 15) for _ in range(8)] + response,
                response="".join(map(str, response)),
                response_length=48,
                loss_mask=[1] * 48,
                rollout_log_probs=[-rng.random() for _ in range(48)],
                reward=float(rng.random() < 0.3),
                label="0357",
                status=Status.TRUNCATED if i % 7 == 0 else Status.COMPLETED,
                metadata={"seed": i},
            )
        )
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "big", 0, samples, per_prompt=8)

    start = time.perf_counter()
    res = invoke(app, "show", str(tmp_path / "runs" / "big"), "--limit", "20")
    seconds = time.perf_counter() - start
    assert res.exit_code == 0, res.output
    assert "samples 1-20 of 10000" in res.output
    assert seconds < 3.0, f"first page took {seconds:.2f}s"

    start = time.perf_counter()
    res = invoke(app, "show", str(tmp_path / "runs" / "big"), "--status", "truncated", "--offset", "1400", "--json")
    seconds = time.perf_counter() - start
    doc = json.loads(res.stdout)
    assert doc["n_matching"] == 1429 and [s["index"] for s in doc["samples"]] == [7 * k for k in range(1400, 1420)]
    assert seconds < 3.0, f"filtered page took {seconds:.2f}s"


def test_show_verifies_checksums(app, hand_store, tmp_path):
    path = tmp_path / "runs" / "hand" / "rollouts" / "train" / "000003" / "samples.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    res = invoke(app, "show", str(tmp_path / "runs" / "hand"))
    assert res.exit_code == 2 and "checksum mismatch" in res.output


# ----------------------------------------------------------------------------- replay-reward


def reward_samples() -> list[Sample]:
    out = []
    for k, response in enumerate(["0357", "0347", "0350", "0357"]):
        out.append(sample(k // 2, k, [4, 5, 6, 7], 1.0 if response == "0357" else 0.0, response=response))
    return out


@pytest.mark.parametrize("fn", ["last_digit", "last_digit_async"])
def test_replay_reward_cli_detects_changed_rewards(app, tmp_path, fn):
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "rw", 0, reward_samples(), per_prompt=2)
    run_uri = str(tmp_path / "runs" / "rw")

    res = invoke(app, "replay-reward", run_uri, "--reward", "tests.reward_fixtures:exact", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n_changed"] == 0

    res = invoke(app, "replay-reward", run_uri, "--reward", f"tests.reward_fixtures:{fn}", "--json")
    doc = json.loads(res.stdout)
    assert doc["changed"] == [1] and doc["old"] == [1.0, 0.0, 0.0, 1.0] and doc["new"] == [1.0, 1.0, 0.0, 1.0]
    assert doc["mean_old"] == 0.5 and doc["mean_new"] == 0.75 and doc["max_abs_diff"] == 1.0

    res = invoke(app, "replay-reward", run_uri, "--reward", f"tests.reward_fixtures:{fn}", "--fail-on-change")
    assert res.exit_code == 1
    assert "changed: 1 of 4 samples" in res.output and "0.5 -> new 0.75" in res.output and "0347" in res.output
    # The artifact itself is untouched.
    assert store.load("rw", "train", 0).samples == reward_samples()


def test_replay_reward_scores_copies_and_dict_rewards():
    samples = reward_samples()
    report = replay_reward(samples, "tests.reward_fixtures:mutating")
    assert samples == reward_samples()  # the function edited only its copies
    assert report.changed == [0, 1, 2, 3] and report.rescored[0].response == "mutated"
    report = replay_reward(samples, "tests.reward_fixtures:as_dict", reward_key="acc")
    assert report.n_changed == 0 and report.rescored[1].reward == {"acc": 0.0, "len": 4.0}
    with pytest.raises(ValueError, match="reward_key"):
        replay_reward(samples, "tests.reward_fixtures:as_dict")


def test_replay_reward_errors(app, tmp_path):
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "rw", 0, reward_samples(), per_prompt=2)
    res = invoke(app, "replay-reward", str(tmp_path / "runs" / "rw"), "--reward", "tests.reward_fixtures:nope")
    assert res.exit_code == 2 and "--reward" in res.output and "no callable 'nope'" in res.output
    res = invoke(app, "replay-reward", str(tmp_path / "runs" / "rw"), "--reward", "tests.reward_fixtures:as_dict")
    assert res.exit_code == 2 and "--reward-key" in res.output


# ----------------------------------------------------------------------------- send (real tiny model)


@pytest.fixture(scope="module")
def greedy_samples():
    from rollflow.tasks.rollout.generate import generate_samples
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
    from rollflow.tasks.rollout.worker import build_engine

    cfg = RolloutConfig()
    engine, tokenizer = build_engine("builtin:addition", cfg)
    items = prompts_for(DataConfig(prompts_per_rollout=16), 0)
    return generate_samples(engine, tokenizer, items, cfg.sampling(0, greedy=True), 1)


def test_send_reproduces_greedy_artifact_and_reports_perturbations(app, tmp_path, greedy_samples):
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "g", 0, greedy_samples, per_prompt=1)
    perturbed = [Sample.from_dict(s.to_dict()) for s in greedy_samples]
    perturbed[3].rollout_log_probs[1] -= 0.5  # a stored log-prob that the engine will not reproduce
    changed = perturbed[5]
    changed.tokens[changed.prompt_length + 1] = 3 if changed.tokens[changed.prompt_length + 1] != 3 else 4
    write(store, "g", 1, perturbed, per_prompt=1)
    run_uri = str(tmp_path / "runs" / "g")

    res = invoke(
        app, "send", run_uri, "--id", "0", "--engine", "hf", "--model", "builtin:addition", "--greedy", "--json"
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["n_samples"] == 16 and doc["identical_fraction"] == 1.0 and doc["first_mismatch"] is None
    assert doc["n_tokens_compared"] == sum(s.response_length for s in greedy_samples)
    assert doc["logprob_abs_diff_max"] < 1e-4 and doc["logprob_exceeding"] == []

    res = invoke(app, "send", run_uri, "--id", "1", "--greedy", "--json")
    doc = json.loads(res.stdout)
    assert doc["n_identical"] == 15 and doc["first_mismatch"]["position"] == 5
    assert doc["first_mismatch"]["first_diff_token"] == 1
    assert doc["logprob_exceeding"] == [3]
    worst = doc["worst_logprob"]
    assert (worst["position"], worst["token"]) == (3, 1) and worst["abs_diff"] == pytest.approx(0.5, abs=1e-4)

    res = invoke(app, "send", run_uri, "--id", "1", "--greedy", "--limit", "8")
    assert res.exit_code == 0, res.output
    assert "identical responses: 7/8" in res.output and "first differing sample: row 5" in res.output
    assert "1 samples with log-prob |diff| > 0.0001" in res.output and "row 3 token 1" in res.output


def test_send_errors(app, tmp_path, greedy_samples, monkeypatch):
    import importlib.util

    import rollflow.tasks.rollout.sglang.server as sglang_server

    # The test setup installs SGLang's pure-Python wheel (contract tests): make it look absent here,
    # as on a machine without the extra, where `send --engine sglang` must say what to install.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        sglang_server.importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )
    store = RolloutStore(str(tmp_path / "runs"))
    write(store, "g", 0, greedy_samples[:2], per_prompt=1)
    run_uri = str(tmp_path / "runs" / "g")
    res = invoke(app, "send", run_uri, "--engine", "sglang", "--greedy")
    assert res.exit_code == 2 and "--engine 'sglang'" in res.output
    res = invoke(app, "send", run_uri, "--engine", "vllm")
    assert res.exit_code == 2 and "--engine" in res.output
    res = invoke(app, "send", run_uri, "--model", str(tmp_path / "no-model"))
    assert res.exit_code == 2 and "--model" in res.output and "config.json" in res.output
