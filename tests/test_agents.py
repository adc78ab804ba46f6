"""Rollout functions (issue 24): token-in/token-out multi-turn samples, tools, limits, turn credit,
conversation feedback, and the flows on multi-turn artifacts."""

from __future__ import annotations

import json

import pytest
import torch

from rollflow.artifacts.sample import Status
from rollflow.tasks.rollout.agent import AgentLimits, resolve_rollout_fn, run_rollout_function
from rollflow.tasks.rollout.engine import SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem
from tests import agent_fixtures

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=7)


class RecordingEngine:
    """The real hf engine, every call's requests and outputs kept."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    @property
    def weight_version(self):
        return self.inner.weight_version

    def generate(self, requests, params):
        out = self.inner.generate(requests, params)
        self.calls.append(([list(r.prompt_ids) for r in requests], [o[0] for o in out]))
        return out


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    from rollflow.tasks.rollout.settings import RolloutConfig
    from rollflow.tasks.rollout.worker import build_engine

    return build_engine("builtin:addition", RolloutConfig())


def _items(n=3):
    from rollflow.tasks.rollout.addition import addition_prompts

    return addition_prompts(n, seed=5)


@pytest.mark.parametrize("fn", ["always_tool", "always_tool_sync"])
def test_trainer_tokens_are_engine_outputs_plus_tool_tokens(engine_and_tokenizer, fn):
    engine, tok = engine_and_tokenizer
    rec = RecordingEngine(engine)
    items = _items()
    samples = run_rollout_function(getattr(agent_fixtures, fn), rec, tok, items, PARAMS, 2, AgentLimits())
    assert len(samples) == 6 and [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    # every engine output, by the exact ids it continued (the samples of a group share their prompt)
    outputs: dict[tuple, list] = {}
    for reqs, outs in rec.calls:
        for ids, out in zip(reqs, outs):
            outputs.setdefault(tuple(ids), []).append(out)
    tool_ids = [3 + "0123456789+=".index(c) for c in agent_fixtures.TOOL_OUTPUT]  # char tokenizer: id = pos + 3
    for s, item in zip(samples, [it for it in items for _ in range(2)]):
        prompt = [tok.bos_token_id] + [3 + "0123456789+=".index(c) for c in item.prompt]
        response = s.tokens[len(prompt) :]
        first = next(o for o in outputs[tuple(prompt)] if response[: len(o.response_ids)] == o.response_ids)
        outputs[tuple(prompt)].remove(first)
        second_input = prompt + first.response_ids + tool_ids
        second = outputs[tuple(second_input)].pop(0)  # the engine saw exactly these ids: no re-tokenisation
        assert s.tokens == second_input + second.response_ids
        assert s.loss_mask == [1] * len(first.response_ids) + [0, 0] + [1] * len(second.response_ids)
        assert s.rollout_log_probs == first.log_probs + [0.0, 0.0] + second.log_probs
        turns = s.metadata["turns"]
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
        assert turns[1]["start"] == len(first.response_ids) and turns[1]["end"] == len(first.response_ids) + 2
    assert not any(outputs.values())  # every engine output is in exactly one sample
    if fn == "always_tool":  # batched: 6 conversations x 2 turns in 2 engine calls, not 12
        assert [len(reqs) for reqs, _ in rec.calls] == [6, 6]


def test_sglang_engine_through_the_same_client(engine_and_tokenizer):
    """Token ids in, token ids + log-probs out over SGLang's /generate (the fake server of the contract tests)."""
    from rollflow.tasks.rollout.sglang.engine import SGLangEngine
    from tests.fake_sglang_server import FakeSGLang

    _, tok = engine_and_tokenizer
    tool_ids = [3 + "0123456789+=".index(c) for c in agent_fixtures.TOOL_OUTPUT]
    with FakeSGLang(vocab_size=15) as fake:
        samples = run_rollout_function(
            agent_fixtures.always_tool,
            SGLangEngine([fake.url], max_inflight=8),
            tok,
            _items(2),
            PARAMS,
            2,
            AgentLimits(),
        )
        inputs = [c[2]["input_ids"] for c in fake.calls("/generate")]
    assert len(inputs) == 8 and all(c is not None for c in inputs)
    for s in samples:
        prompt_len = s.prompt_length
        first_len = s.metadata["turns"][0]["end"]
        second_input = s.tokens[: prompt_len + first_len] + tool_ids
        assert s.tokens[: len(second_input)] == second_input and second_input in inputs  # sent as ids, as built
        assert s.tokens[:prompt_len] in inputs
        assert s.loss_mask == [1] * first_len + [0, 0] + [1] * (s.response_length - first_len - 2)
        assert all(lp < 0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)  # the server's log-probs


def test_rollout_is_deterministic(engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    a = run_rollout_function(agent_fixtures.always_tool, engine, tok, _items(), PARAMS, 2, AgentLimits())
    b = run_rollout_function(agent_fixtures.always_tool, engine, tok, _items(), PARAMS, 2, AgentLimits())
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert len({tuple(s.tokens) for s in a}) > 1  # and the samples of a group differ


def test_raising_and_slow_tools_are_failed_turns(engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    # room for the model's eos: a turn cut at max_new_tokens is no complete call
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    samples = run_rollout_function(
        agent_fixtures.raising_tool_agent, engine, tok, _items(2), params, 2, AgentLimits(max_turns=2)
    )
    for s in samples:
        tools = [t for t in s.metadata["turns"] if t["role"] == "tool"]
        assert len(tools) == 2 and all(t["ok"] is False and t["error"].startswith("RuntimeError: boom") for t in tools)
        assert s.status == Status.TRUNCATED  # still calling a tool after max_turns: no final answer
        assert sum(t["role"] == "assistant" for t in s.metadata["turns"]) == 2
    samples = run_rollout_function(
        agent_fixtures.slow_tool_agent, engine, tok, _items(1), params, 1, AgentLimits(max_turns=1, tool_timeout_s=0.2)
    )
    tool = samples[0].metadata["turns"][1]
    assert tool["ok"] is False and tool["error"] == "timeout after 0.2s"


def test_failing_or_hanging_function_is_a_failed_sample(engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    for fn, error in [
        (agent_fixtures.raises, "raised KeyError"),
        (agent_fixtures.hangs, "timed out after 0.3s"),
        (agent_fixtures.hangs_sync, "timed out after 0.3s"),
    ]:
        samples = run_rollout_function(fn, engine, tok, _items(1), PARAMS, 2, AgentLimits(sample_timeout_s=0.3))
        assert [s.status for s in samples] == [Status.FAILED, Status.FAILED]
        assert all(error in s.metadata["error"] and s.response_length == 0 for s in samples)


def test_token_budget_truncates(engine_and_tokenizer):
    engine, tok = engine_and_tokenizer
    samples = run_rollout_function(
        agent_fixtures.always_tool, engine, tok, _items(2), PARAMS, 2, AgentLimits(max_total_tokens=3)
    )
    for s in samples:  # always_tool ignores the budget: the runner cuts its samples
        assert s.response_length == 3 and len(s.loss_mask) == len(s.rollout_log_probs) == 3
        assert s.status == Status.TRUNCATED
        assert all(t["start"] < 3 and t["end"] <= 3 for t in s.metadata["turns"])


def test_calc_example(engine_and_tokenizer):
    from rollflow.tasks.rollout.calc_agent import calc, calc_reward, calc_rollout
    from rollflow.tasks.rollout.conversation import Conversation
    from rollflow.tasks.rollout.engine import GenerationOutput

    assert calc("12+45") == "57" and calc("1+2+3") == "6"
    for bad in ("09", "", "1++2", "+3"):
        with pytest.raises(ValueError, match="calc"):
            calc(bad)
    engine, tok = engine_and_tokenizer
    item = PromptItem("012+345=", "0357")
    ids = lambda text: tok.encode(text)  # noqa: E731
    # a conversation written by hand: call, tool result, final answer
    conv = Conversation([tok.bos_token_id] + ids("012+345="), tok)
    conv.add_model(GenerationOutput(ids("12+345="), [-0.1] * 7, "stop"))
    conv.add_text("tool", calc("12+345"), name="calc", arguments="12+345", ok=True)
    conv.add_model(GenerationOutput(ids("0357") + [tok.eos_token_id], [-0.1] * 5, "stop"))
    assert calc_reward(conv.to_sample(item)) == 1.0
    samples = run_rollout_function(
        calc_rollout, engine, tok, _items(4), SamplingParams(max_new_tokens=5, seed=1), 4, AgentLimits(max_turns=3)
    )
    for s in samples:
        turns = s.metadata["turns"]
        for turn, nxt in zip(turns, turns[1:]):
            if turn["role"] == "assistant":  # only a turn ending in '=' is followed by a calc turn
                assert turn["text"].endswith("=") and nxt["role"] == "tool" and nxt["name"] == "calc"
        assert calc_reward(s) == float(s.status == Status.COMPLETED and turns[-1]["text"] == s.label)


def test_bad_function_path_is_one_config_error():
    from rollflow.flows.config import RunConfig

    with pytest.raises(ValueError, match="rollout.function='nope.missing:fn': cannot import module"):
        RunConfig.model_validate({"rollout": {"function": "nope.missing:fn"}})
    with pytest.raises(ValueError, match="rollout.feedback.judge"):
        RunConfig.model_validate({"rollout": {"reward": "conversation_feedback"}})
    assert resolve_rollout_fn("tests.agent_fixtures:always_tool") is agent_fixtures.always_tool


# ---- turn-level credit ----------------------------------------------------------------------------------


def test_grpo_turn_rewards_credit_their_turns():
    from rollflow.tasks.train.advantages import compute_advantages

    # two samples of one group; sample 0: model tokens 0-1 (turn reward 1), tool 2, model 3-4 (turn reward 0);
    # sample 1: one model turn of 3 tokens whose sample reward is 0.5
    masks = [torch.tensor([1.0, 1, 0, 1, 1]), torch.tensor([1.0, 1, 1])]
    units = [[(0, 2, 1.0), (3, 5, 0.0)], []]
    adv, _ = compute_advantages("grpo", torch.tensor([0.5, 0.5], dtype=torch.float64), masks, 2, turn_units=units)
    values = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    mean, std = values.mean(), values.std()
    expect0 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(adv[0], ((expect0 - mean) / (std + 1e-6)) * masks[0].double())
    assert torch.allclose(adv[1], torch.full((3,), float((0.5 - mean) / (std + 1e-6)), dtype=torch.float64))


def test_reinforce_turn_rewards_land_on_turn_ends():
    from rollflow.tasks.train.advantages import compute_advantages

    masks = [torch.tensor([1.0, 1, 0, 0, 1])]
    _, returns = compute_advantages(
        "reinforce_plus_plus",
        torch.tensor([9.0], dtype=torch.float64),
        masks,
        1,
        gamma=0.5,
        turn_units=[[(0, 2, 1.0), (4, 5, -1.0)]],
    )
    # rewards: 1 at index 1, -1 at index 4; R_t = r_t + 0.5 R_{t+1}
    r4, r3, r2 = -1.0, -0.5, -0.25
    r1 = 1.0 + 0.5 * r2
    r0 = 0.5 * r1
    assert torch.allclose(returns[0], torch.tensor([r0, r1, r2, r3, r4], dtype=torch.float64))
    with pytest.raises(ValueError, match="turn-level rewards"):
        compute_advantages(
            "rloo", torch.tensor([1.0, 0.0]), [torch.ones(2), torch.ones(2)], 2, turn_units=[[(0, 1, 1.0)], []]
        )


# ---- conversation feedback ---------------------------------------------------------------------------


def test_majority_and_verdicts():
    from rollflow.tasks.rollout.feedback import majority, verdict_value

    assert majority([1.0, 1.0, -1.0]) == 1.0 and majority([1.0, -1.0]) == 0.0
    assert verdict_value("Good.") == 1.0 and verdict_value(" bad answer") == -1.0 and verdict_value(0.25) == 0.25
    with pytest.raises(ValueError, match="judge verdict"):
        verdict_value("maybe")


def test_engine_judge_votes_on_each_turn(engine_and_tokenizer):
    from rollflow.tasks.rollout.feedback import judged_turns_reward, majority, verdict_value

    engine, tok = engine_and_tokenizer
    rec = RecordingEngine(engine)
    samples = run_rollout_function(agent_fixtures.judged_always_tool, rec, tok, _items(2), PARAMS, 2, AgentLimits())
    judge_inputs = [ids for reqs, _ in rec.calls[2:] for ids in reqs]  # after the two conversation turns
    assert len(rec.calls) == 3 and len(judge_inputs) == 4 * 3  # one batched call: 4 judged turns x 3 votes
    for s in samples:
        first, tool, _ = s.metadata["turns"]
        assert len(first["votes"]) == 3 and first["reward"] == majority(first["votes"])
        judge_ids = [tok.bos_token_id] + tok.encode(f"{first['text']}+{tool['text']}=")
        assert judge_inputs.count(judge_ids) >= 3  # the judge prompt went to the engine as ids
        outs = [
            decode
            for reqs, outs in rec.calls[2:]
            for ids, o in zip(reqs, outs)
            if ids == judge_ids
            for decode in [tok.decode(o.response_ids)]
        ]
        assert all(v in [verdict_value(o) for o in outs] for v in first["votes"])
        assert judged_turns_reward(s) == first["reward"]


def test_logged_conversation_tokens_and_feedback(engine_and_tokenizer):
    import asyncio

    from rollflow.tasks.rollout.feedback import feedback_reward, logged_conversation

    _, tok = engine_and_tokenizer
    messages = [
        {"role": "user", "content": "12+30="},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "0"},
        {"role": "assistant", "content": "0042"},
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": "7"},
    ]
    samples = run_rollout_function(
        logged_conversation, None_engine(), tok, [PromptItem(messages, None)], PARAMS, 1, AgentLimits()
    )
    s = samples[0]
    ids = lambda text: [3 + "0123456789+=".index(c) for c in text]  # noqa: E731
    eos = tok.eos_token_id
    assert s.tokens == [tok.bos_token_id] + ids("12+30=") + ids("42") + [eos] + ids("0") + ids("0042") + [eos] + ids(
        "1"
    ) + ids("7") + [eos]
    assert s.loss_mask == [1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1]
    reward = asyncio.run(feedback_reward(agent_fixtures.feedback_judge, votes=3)(s))
    assert [t.get("reward") for t in s.metadata["turns"]] == [-1.0, None, 1.0, None, None]
    assert reward == 0.0 and s.metadata["rollout_log_probs_missing"] is True


class None_engine:  # noqa: N801 - logged conversations never call the engine
    weight_version = 0

    def generate(self, requests, params):
        raise AssertionError("logged conversations generate nothing")


# ---- through the flows ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_multi_turn_artifact_trains_and_replays_bit_for_bit(tmp_path, prefect_api, ray_local):
    from rollflow.artifacts import RolloutStore
    from rollflow.flows.debug import replay_train
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from rollflow.tasks.debug.display import filter_samples, load_sample_table, render_table, rollout_metrics
    from tests.conftest import small_config

    agent = {"function": "tests.agent_fixtures:always_tool", "n_samples_per_prompt": 4}
    cfg = small_config(tmp_path, run="mt", iterations=1, data={"prompts_per_rollout": 8}, rollout=agent)
    rl_train(cfg)
    trained = read_metrics(cfg)[0]
    samples = RolloutStore(str(tmp_path)).load("mt", "train", 0).samples
    assert all(0 in s.loss_mask and s.loss_mask[0] == 1 for s in samples)  # holes
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_table(samples, limit=2, max_chars=200))
    assert "[tool echo ok] 99" in console.export_text()

    table = load_sample_table(RolloutStore(str(tmp_path)), "mt", "train", 0)  # show's columnar path
    assert len(filter_samples(table, min_turns=3)) == len(samples) and len(filter_samples(table, min_turns=4)) == 0
    stats = rollout_metrics(table)
    assert stats["multi_turn_fraction"] == 1.0 and stats["tool_calls"] == len(samples) and stats["tool_failures"] == 0

    dumps = tmp_path / "dumps"
    replay_cfg = small_config(
        tmp_path,
        run="mt-replay",
        data={"prompts_per_rollout": 8},
        rollout=agent,
        debug={"train_only": True, "dump_details": str(dumps)},
    )
    replay = replay_train(replay_cfg, rollout_ids=[0], source_run="mt", use_cache=False)
    step = replay["steps"][0]
    keys = [k for k in step if k.startswith("train/") and k in trained]
    assert "train/loss" in keys and "train/grad_norm" in keys
    assert {k: step[k] for k in keys} == {k: trained[k] for k in keys}
    assert (dumps / "mt-replay" / "train_dumps" / "000000.parquet").exists()  # --dump-details on holes


@pytest.mark.slow
def test_logged_conversations_with_feedback_train_through_the_flow(tmp_path, prefect_api, ray_local):
    from rollflow.artifacts import RolloutStore
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train
    from tests.conftest import small_config

    rows = []
    for i in range(8):
        a, b = 10 + i, 20 + 2 * i
        good = str(a + b)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a}+{b}="},
                    {"role": "assistant", "content": "1"},
                    {"role": "user", "content": "0"},
                    {"role": "assistant", "content": good},
                    {"role": "user", "content": "1"},
                ]
            }
        )
    path = tmp_path / "logged.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = small_config(
        tmp_path,
        run="fb",
        iterations=1,
        data={
            "task": "dataset",
            "path": str(path),
            "input_key": "messages",
            "apply_chat_template": True,
            "label_key": None,
            "prompts_per_rollout": 8,
        },
        rollout={
            "function": "rollflow.tasks.rollout.feedback:logged_conversation",
            "n_samples_per_prompt": 1,
            "reward": "conversation_feedback",
            "feedback": {"judge": "tests.agent_fixtures:feedback_judge"},
        },
        algo={"advantage_estimator": "reinforce_plus_plus_baseline"},
        debug={"dump_details": str(tmp_path / "dumps")},
    )
    rl_train(cfg)
    samples = RolloutStore(str(tmp_path)).load("fb", "train", 0).samples
    for s in samples:
        assert [t.get("reward") for t in s.metadata["turns"]] == [-1.0, None, 1.0, None]
        assert s.reward == 0.0
    row = read_metrics(cfg)[0]
    assert row["train/grad_norm"] > 0 and row["rollout/advantages"] == pytest.approx(0.0, abs=1e-6)
    # turn-level credit: the turn the user rejected ("1" + eos) pushed down, the accepted answer (2 digits + eos) up
    import pyarrow.parquet as pq

    dump = pq.read_table(tmp_path / "dumps" / "fb" / "train_dumps" / "000000.parquet").to_pylist()
    for d in dump:
        assert len(d["advantages"]) == 5
        assert all(a < 0 for a in d["advantages"][:2]) and all(a > 0 for a in d["advantages"][2:])
