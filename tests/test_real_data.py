"""Real models and real data (issue 10), without Prefect or Ray: HF model directories, tokenization
with and without a chat template, JSONL / parquet prompt sets with epochs and a resumable cursor,
eval sampling and pass@k."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest

from rollflow.tasks.model.source import ModelDirError, check_model_dir, resolve_model_path
from rollflow.tasks.model.tokenizer import CharTokenizer, load_tokenizer, prompt_token_ids
from rollflow.tasks.rollout.dataset import (
    DataExhausted,
    DataResumeMismatch,
    check_resume,
    data_state,
    epoch_order,
    load_records,
)
from rollflow.tasks.rollout.evaluation import eval_summary, pass_at_k
from rollflow.tasks.rollout.generate import build_requests
from rollflow.tasks.rollout.prompts import PromptItem
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
from tests.hf_fixtures import build_model_dir, build_tokenizer, write_jsonl

ROWS = [
    {"question": f"What is {i} plus {i + 1}?", "answer": 2 * i + 1, "source": "toy", "level": i % 3} for i in range(10)
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def data_cfg(path, **kw):
    base = dict(task="dataset", path=str(path), input_key="question", label_key="answer", prompts_per_rollout=4)
    return DataConfig(**(base | kw))


# ---- model directories ---------------------------------------------------------------------------


def test_model_dir_checks_name_the_missing_piece(model_dir, tmp_path):
    info = check_model_dir(model_dir)
    assert info["family"] == "Llama" and info["tokenizer"] == "tokenizer.json" and info["chat_template"]
    assert resolve_model_path(str(model_dir)) == model_dir
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(ModelDirError, match="missing config.json"):
        resolve_model_path(str(broken))
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelDirError, match="missing model.safetensors"):
        resolve_model_path(str(broken))
    (broken / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="pickled weights are not loaded"):
        resolve_model_path(str(broken))
    (broken / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="missing its tokenizer"):
        resolve_model_path(str(broken))
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ValueError, match=r"model_type='gpt2' \(GPT2LMHeadModel\) is not supported.*Llama / Qwen2 / Qwen3"
    ):
        resolve_model_path(str(broken))
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    (shards / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="model-00002-of-00002.safetensors"):
        check_model_dir(shards)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_families_load(tmp_path, arch):
    from rollflow.tasks.model.tiny import load_model

    path = build_model_dir(tmp_path / arch, arch=arch)
    assert check_model_dir(path)["model_type"] == arch
    import torch

    model = load_model(path, dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64


# ---- tokenization: special tokens exactly once -----------------------------------------------------


def test_text_prompts_get_the_tokenizers_bos_once(model_dir):
    tok = load_tokenizer(model_dir)
    ids = prompt_token_ids(tok, "2+3")
    assert ids == [tok.bos_token_id] + tok("2+3", add_special_tokens=False)["input_ids"]
    # rollflow's char tokenizer adds nothing in encode(): the bos comes from prompt_token_ids, once.
    char = load_tokenizer(resolve_model_path("builtin:addition"))
    assert isinstance(char, CharTokenizer)
    assert prompt_token_ids(char, "012+345=") == [char.bos_token_id] + char.encode("012+345=")


def test_chat_prompts_render_the_template_without_a_second_bos(model_dir):
    tok = load_tokenizer(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    ids = prompt_token_ids(tok, messages)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>Be brief.</s><s><|user|>2+3?</s><s><|assistant|>"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # not "<s><s>..."
    assert tok.decode(ids) == text
    no_template = build_tokenizer(chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        prompt_token_ids(no_template, messages)


def test_dataset_prompts_with_and_without_chat_template(model_dir, jsonl):
    tok = load_tokenizer(model_dir)
    plain = prompts_for(data_cfg(jsonl, shuffle=False, metadata_keys=["source"]), 0)
    assert plain[0] == PromptItem("What is 0 plus 1?", "1", {"source": "toy", "data_index": 0, "data_epoch": 0})
    req = build_requests(plain[:1], tok, 3)[0]
    assert req.n == 3 and req.prompt_ids == prompt_token_ids(tok, "What is 0 plus 1?")
    chat = prompts_for(
        data_cfg(jsonl, shuffle=False, apply_chat_template=True, system_prompt="Answer with a number."), 0
    )
    assert chat[1].prompt == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 1 plus 2?"},
    ]
    ids = build_requests(chat[1:2], tok, 1)[0].prompt_ids
    assert tok.decode(ids) == "<s><|system|>Answer with a number.</s><s><|user|>What is 1 plus 2?</s><s><|assistant|>"
    with_system = prompts_for(data_cfg(jsonl, shuffle=False, system_prompt="Answer:"), 0)
    assert with_system[0].prompt == "Answer:\n\nWhat is 0 plus 1?"


def test_jsonl_parquet_and_fsspec_urls_read_alike(tmp_path, jsonl):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    with fsspec.open("memory://issue10/train.jsonl", "wb") as f:
        f.write(jsonl.read_bytes())
    want = prompts_for(data_cfg(jsonl), 1)
    for path in (tmp_path / "train.parquet", f"file://{jsonl}", "memory://issue10/train.jsonl"):
        assert prompts_for(data_cfg(path), 1) == want
    assert len(load_records(str(jsonl))) == 10


def test_dataset_errors_are_specific(tmp_path, jsonl):
    with pytest.raises(KeyError, match=r"record 0 .* has no 'prompt' \(data.input_key\)"):
        prompts_for(data_cfg(jsonl, input_key="prompt", shuffle=False), 0)
    with pytest.raises(KeyError, match="data.label_key=null"):
        prompts_for(data_cfg(jsonl, label_key="solution", shuffle=False), 0)
    assert prompts_for(data_cfg(jsonl, label_key=None), 0)[0].label is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_records(str(bad))
    with pytest.raises(ValueError, match="needs data.path"):
        DataConfig(task="dataset")
    with pytest.raises(ValueError, match="set data.task='dataset'"):
        DataConfig(path=str(jsonl))
    with pytest.raises(ValueError, match="pass_k"):
        data_cfg(jsonl, eval={"path": str(jsonl), "n_samples_per_prompt": 2, "pass_k": [1, 4]})


# ---- epochs, shuffling and the cursor --------------------------------------------------------------


def test_epochs_visit_every_record_once_in_fresh_orders(jsonl):
    cfg = data_cfg(jsonl, prompts_per_rollout=4, seed=7)
    seen = [(it.metadata["data_epoch"], it.metadata["data_index"]) for r in range(5) for it in prompts_for(cfg, r)]
    assert len(seen) == 20
    for epoch in (0, 1):
        assert sorted(i for e, i in seen if e == epoch) == list(range(10))
    assert epoch_order(10, 7, 0, True) != epoch_order(10, 7, 1, True)  # reshuffled per epoch
    assert epoch_order(10, 7, 1, True) == epoch_order(10, 7, 1, True)  # deterministic
    # rollout 2 straddles the boundary: positions 8, 9 of epoch 0, then 0, 1 of epoch 1
    assert [it.metadata["data_epoch"] for it in prompts_for(cfg, 2)] == [0, 0, 1, 1]
    with pytest.raises(DataExhausted, match="data.epochs=2 x 10 records"):
        prompts_for(data_cfg(jsonl, epochs=2), 5)


def test_resume_cursor_across_an_epoch_boundary(jsonl):
    cfg = data_cfg(jsonl, prompts_per_rollout=4, seed=3)
    uninterrupted = [prompts_for(cfg, r) for r in range(4)]
    # Checkpoint after 2 iterations (8 samples): the cursor sits 2 records before the epoch's end.
    saved = data_state(cfg, 2)
    assert {k: saved[k] for k in ("epoch", "offset", "samples_consumed", "n_records", "shuffle_seed")} == {
        "epoch": 0,
        "offset": 8,
        "samples_consumed": 8,
        "n_records": 10,
        "shuffle_seed": 3,
    }
    # A fresh process (no cached state) resumes from the config alone at the same samples.
    load_records.cache_clear()
    epoch_order.cache_clear()
    resumed_cfg = DataConfig.model_validate(json.loads(cfg.model_dump_json()))
    check_resume(saved, data_state(resumed_cfg, 2), 2)
    assert [prompts_for(resumed_cfg, r) for r in (2, 3)] == uninterrupted[2:]
    assert data_state(resumed_cfg, 3)["epoch"] == 1 and data_state(resumed_cfg, 3)["offset"] == 2
    # What would silently continue at another sample is refused, naming the difference.
    for change, field in (
        ({"prompts_per_rollout": 5}, "samples_consumed"),
        ({"seed": 4}, "shuffle_seed"),
        ({"shuffle": False}, "shuffle"),
    ):
        with pytest.raises(DataResumeMismatch, match=field):
            check_resume(saved, data_state(data_cfg(jsonl, **({"prompts_per_rollout": 4, "seed": 3} | change)), 2), 2)
    write_jsonl(jsonl, ROWS[:9])  # the file changed under the run
    load_records.cache_clear()
    with pytest.raises(DataResumeMismatch, match="sha256"):
        check_resume(saved, data_state(cfg, 2), 2)


# ---- eval: its own sampling and pass@k ----------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(combinations(range(n), k))  # samples 0..c-1 are the correct ones
                brute = sum(any(i < c for i in d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(brute)
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1) and pass_at_k(10, 0, 5) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    assert math.isclose(pass_at_k(200, 3, 100), 1 - math.comb(197, 100) / math.comb(200, 100))


def _scored(rewards_by_group):
    from rollflow.artifacts.sample import Sample

    return [
        Sample(
            group_index=g,
            index=i,
            prompt="p",
            tokens=[1, 2],
            response="r",
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-1.0],
            reward=r,
        )
        for g, rs in enumerate(rewards_by_group)
        for i, r in enumerate(rs)
    ]


def test_eval_summary():
    out = eval_summary(_scored([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]), ks=[1, 2, 4])
    assert out["eval/accuracy"] == pytest.approx(5 / 12)
    assert out["eval/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert out["eval/pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert eval_summary(_scored([[0.9, 0.2]]), ks=[1], threshold=0.5)["eval/pass@1"] == 0.5
    assert set(eval_summary(_scored([[1.0]]))) == {"eval/accuracy"}  # the built-in task's eval, unchanged


def test_worker_on_an_hf_directory_with_chat_template_and_eval_sampling(model_dir, jsonl, tmp_path):
    """Generation, rewards, training and eval on a real HF directory (random tiny Llama)."""
    from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
    from rollflow.tasks.train.step import train_on_samples
    from rollflow.tasks.train.worker import build_backend

    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS[:3])
    data = data_cfg(
        jsonl,
        apply_chat_template=True,
        system_prompt="Answer with a number.",
        eval={
            "path": str(eval_path),
            "n_samples_per_prompt": 4,
            "temperature": 1.0,
            "max_new_tokens": 3,
            "pass_k": [1, 4],
        },
    )
    rollout = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=6, reward="math")
    worker = RolloutWorker(str(model_dir), rollout, data)
    samples = score_samples(worker.rollout(0), reward_fn_from_config(rollout))
    assert len(samples) == 8 and isinstance(samples[0].prompt, list)
    tok = worker.tokenizer
    first = samples[0]
    assert first.tokens[: first.prompt_length] == prompt_token_ids(tok, first.prompt)
    assert first.tokens.count(tok.bos_token_id) >= 3 and first.tokens[1] != tok.bos_token_id
    assert "<|assistant|>" not in first.response  # special tokens are not part of the response text
    assert first.metadata["data_epoch"] == 0 and "data_index" in first.metadata
    backend = build_backend(str(model_dir), OptimConfig(num_steps_per_rollout=1, micro_batch_size=4), temperature=1.0)
    metrics = train_on_samples(backend, samples, AlgoConfig(), group_size=2).metrics
    assert metrics["rollout/log_probs_equal_ref"] == 1.0
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4
    evals = worker.rollout(0, "eval", greedy=True)  # data.eval's sampling wins over greedy
    assert len(evals) == 3 * 4 and max(s.response_length for s in evals) <= 3
    out = eval_summary(score_samples(evals, reward_fn_from_config(rollout)), ks=[1, 4])
    assert {"eval/accuracy", "eval/pass@1", "eval/pass@4"} <= set(out)


def test_retokenize_agreement_tells_language_from_arbitrary_ids():
    """The coherence figure that catches a real LM with shuffled weights (confident about its own noise,
    so its reference NLL looks fine): arbitrary id sequences are not what the tokenizer produces."""
    import random

    from rollflow.artifacts.sample import Sample
    from rollflow.tasks.debug.checks import AlignmentThresholds
    from rollflow.tasks.debug.coherence import coherence_check, response_stats, retokenize_agreement
    from tests.hf_fixtures import CORPUS, build_bpe_tokenizer

    tok = build_bpe_tokenizer()

    def as_samples(responses):
        return [
            Sample(
                group_index=i,
                index=i,
                prompt="p",
                tokens=[1] + r,
                response=tok.decode(r),
                response_length=len(r),
                loss_mask=[1] * len(r),
                rollout_log_probs=[-0.5] * len(r),
            )
            for i, r in enumerate(responses)
        ]

    text = as_samples([tok(t, add_special_tokens=False)["input_ids"] for t in CORPUS[:4]])
    rng = random.Random(0)
    noise = as_samples([[rng.randrange(3, len(tok)) for _ in range(40)] for _ in range(4)])
    assert retokenize_agreement(tok, text) == 1.0
    assert retokenize_agreement(tok, noise) < 0.9
    assert retokenize_agreement(CharTokenizer("0123456789+=", 15), text) is None  # char tokenizer: not judged
    thr = AlignmentThresholds()
    ok = coherence_check(response_stats(tok, text, None), 0.5, thr)
    assert ok.status == "pass" and ok.figures["retokenize_agreement"] == 1.0
    bad = coherence_check(response_stats(tok, noise, None), 0.5, thr)
    assert bad.status == "fail" and "retokenize_agreement" in bad.message
