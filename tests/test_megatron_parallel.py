"""TP=2, PP=2 (also interleaved) and DP=2 Megatron training equals the single-rank objective (2 processes, gloo,
CPU), on tiny Llama, Qwen2 (QKV bias, tied embeddings) and Qwen3 (q/k norms) models.

The reference is built independently of the code under test: plain HF transformers (fp32), log-probs by
`log_softmax`, the shared objective over the whole batch, `clip_grad_norm_` and torch AdamW. Each parallel
layout runs the megatron backend's product path (Megatron's DDP, `get_forward_backward_func`,
`finalize_model_grads`, Megatron's optimizer, vocab-parallel log-probs) in two spawned processes, for 1
and 4 micro-batches, and must give the same log-probs, loss, grad norm (which catches any loss-scaling
error that Adam's scale invariance would hide) and updated weights.
"""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch

from rollflow.tasks.net import free_port
from rollflow.tasks.sync.parity import checksums

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (pip install 'rollflow[megatron]')")

N_SAMPLES = 8
LR = 1e-3
# (name, tp, pp, micro-batches per data-parallel rank, other train.megatron settings); dp = 2 / (tp * pp * cp)
BUCKET_BYTES = 32 << 10  # the streamed export's bucket size in the layouts below (a layer's tensors are 8-64 KB)
LAYOUTS = {
    "llama": [
        ("tp2_mb1", 2, 1, 1, {}),
        ("tp2_mb4", 2, 1, 4, {}),
        ("pp2_mb4", 1, 2, 4, {}),
        ("pp2_vpp2_mb4", 1, 2, 4, {"vpp": 2}),
        ("dp2_mb1", 1, 1, 1, {}),
        ("dp2_mb4", 1, 1, 4, {}),
        ("dp2_distopt_mb4", 1, 1, 4, {"use_distributed_optimizer": True}),
        ("tp2_tokens48", 2, 1, 1, {"max_tokens_per_gpu": 48}),
        # packed rows (THD): per-row attention and RoPE, log-probs gathered back to the rows
        ("tp2_packed_mb4", 2, 1, 4, {"packing": "thd"}),
        ("pp2_packed_mb4", 1, 2, 4, {"packing": "thd"}),
        ("dp2_packed_tokens60", 1, 1, 1, {"packing": "thd", "max_tokens_per_gpu": 60}),
        # context parallel: each sequence split over 2 ranks (zigzag chunks), keys / values all-gathered
        # with the compiled RoPE hooks (the CUDA default; rope_thd finds each rank's positions itself)
        ("cp2_mb4", 1, 1, 4, {"cp": 2, "rope_fusion": "compiled"}),
        ("cp2_packed_mb4", 1, 1, 4, {"cp": 2, "packing": "thd", "rope_fusion": "compiled"}),
        ("cp2_packed_tokens30", 1, 1, 1, {"cp": 2, "packing": "thd", "max_tokens_per_gpu": 30}),
        # sequence parallel: norms on each TP rank's part of the sequence, their grads summed over TP
        ("tp2_sp_mb4", 2, 1, 4, {"sequence_parallel": True}),
        ("tp2_sp_packed_mb1", 2, 1, 1, {"sequence_parallel": True, "packing": "thd"}),
    ],
    "qwen2": [
        ("tp2_mb4", 2, 1, 4, {}),
        ("pp2_mb4", 1, 2, 4, {}),
        ("pp2_vpp2_mb1", 1, 2, 1, {"vpp": 2}),
        ("dp2_mb4", 1, 1, 4, {}),
        ("tp2_packed_mb1", 2, 1, 1, {"packing": "thd"}),
    ],
    # q/k norms are replicated over TP but each rank sees its own heads: their grads must be summed over TP
    "qwen3": [
        ("tp2_mb4", 2, 1, 4, {}),
        ("tp2_packed_mb4", 2, 1, 4, {"packing": "thd"}),
        ("tp2_sp_mb1", 2, 1, 1, {"sequence_parallel": True}),
        ("cp2_packed_mb1", 1, 1, 1, {"cp": 2, "packing": "thd"}),
    ],
}


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    if kind == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)  # QKV bias, tied embeddings
    if kind == "qwen3":
        return Qwen3Config(tie_word_embeddings=False, head_dim=16, **common)  # q_norm / k_norm
    return LlamaConfig(tie_word_embeddings=False, **common)


def _hf_model(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # biases and norms away from 0 / 1
    return model


def _batch(vocab: int):
    from rollflow.artifacts.sample import Sample
    from rollflow.tasks.train.batch import batch_from_samples

    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(N_SAMPLES):
        plen, rlen = int(torch.randint(3, 10, (1,), generator=g)), int(torch.randint(4, 20, (1,), generator=g))
        samples.append(
            Sample(
                group_index=i // 4,
                index=i,
                prompt="p",
                tokens=torch.randint(3, vocab, (plen + rlen,), generator=g).tolist(),
                response="",
                response_length=rlen,
                loss_mask=[1] * rlen,
                rollout_log_probs=[-5.0] * rlen,
                reward=float(i % 2),
            )
        )
    batch = batch_from_samples(samples, group_size=4)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def _algo():
    from rollflow.tasks.train.settings import AlgoConfig

    return AlgoConfig(kl_loss_coef=0.1, entropy_coef=0.01)


def _hf_log_probs(model, batch, grad: bool):
    with torch.set_grad_enabled(grad):
        logits = (
            model(input_ids=batch.tokens, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
            .logits[:, :-1]
            .float()
        )
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _reference(kind: str):
    """Single rank, plain HF: log-probs, loss, grad norm and the weights after one AdamW step."""
    from rollflow.tasks.train.objective import Denominators, micro_batch_objective

    model = _hf_model(kind)
    batch = _batch(model.config.vocab_size)
    lp, _ = _hf_log_probs(model, batch, grad=False)
    batch.log_probs = lp * batch.response_mask
    batch.ref_log_probs = batch.log_probs - 0.05 * batch.response_mask
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new_lp, ent = _hf_log_probs(model, batch, grad=True)
    loss, _ = micro_batch_objective(new_lp, ent, batch, _algo(), Denominators.of(batch))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8).step()
    updated = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dict(
        config=model.config,
        state=state,
        batch=batch,
        log_probs=lp,
        loss=float(loss),
        grad_norm=float(norm),
        updated=updated,
    )


def _vocab_parallel_check(rank: int, device: torch.device) -> dict:
    """vocab_parallel_log_probs over the 2-rank group: values and logit grads, to compare with one rank."""
    from rollflow.tasks.train.megatron.vocab_parallel import vocab_parallel_log_probs

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5, 2 * 40, generator=g, dtype=torch.float64) * 3  # vocab 70 real + 10 padding
    target = torch.randint(0, 70, (6, 5), generator=g)
    w_lp = torch.randn(6, 5, generator=g, dtype=torch.float64)
    w_ent = torch.randn(6, 5, generator=g, dtype=torch.float64)
    shard = logits[..., rank * 40 : (rank + 1) * 40].to(device).requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        shard,
        target.to(device),
        vocab_start=rank * 40,
        vocab_size=70,
        temperature=0.7,
        group=torch.distributed.group.WORLD,
    )
    (lp * w_lp.to(device) + ent * w_ent.to(device)).sum().backward()
    return dict(
        logits=logits,
        target=target,
        w_lp=w_lp,
        w_ent=w_ent,
        lp=lp.detach().cpu(),
        ent=ent.detach().cpu(),
        grad=shard.grad.cpu(),
    )


def _rank_main(rank: int, world: int, port: int, refs: dict, out_dir: str, device_type: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    from megatron.core import parallel_state

    from rollflow.tasks.train.data_parallel import DataParallel
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.process import destroy_parallel_state
    from rollflow.tasks.train.settings import OptimConfig
    from rollflow.tasks.train.worker import TrainWorker
    from tests.megatron_cpu_shim import cpu_megatron

    def backend(ref, tp, pp, n_micro, extra=None):
        dp_size = world // (tp * pp * (extra or {}).get("cp", 1))
        device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
        optim = OptimConfig(
            backend="megatron",
            device=device,
            dtype="float32",
            lr=LR,
            num_steps_per_rollout=1,
            micro_batch_size=N_SAMPLES // dp_size // n_micro,
            megatron={"layer_spec": "sdpa", "optimizer": "megatron", "tp": tp, "pp": pp, **(extra or {})},
        )
        return MegatronBackend(
            ref["config"],
            ref["state"],
            optim,
            keep_ref=False,
            dp=DataParallel(rank, world, "127.0.0.1", port, backend="nccl" if device_type == "cuda" else "gloo"),
        )

    results: dict = {}
    ckpt = os.path.join(out_dir, "ckpt_tp2")
    with cpu_megatron() if device_type == "cpu" else contextlib.nullcontext():
        for kind, ref in refs.items():
            for name, tp, pp, n_micro, extra in LAYOUTS[kind]:
                be = backend(ref, tp, pp, n_micro, extra)
                exported = be.named_weights()
                buckets = [[(n, t.to("cpu", copy=True)) for n, t in b] for b in be.export_buckets(BUCKET_BYTES)]
                # the trainer's parity fingerprints, as a bf16 engine asks for them (streamed: a collective)
                fingerprints = TrainWorker.weight_checksums(types.SimpleNamespace(backend=be), "bfloat16")
                names_by_rank: list = [None] * world
                torch.distributed.all_gather_object(names_by_rank, [[n for n, _ in b] for b in buckets])
                log_probs = be.compute_log_probs(ref["batch"])
                stats = be.train(ref["batch"], _algo())
                results[(kind, name)] = dict(
                    exported=exported,
                    buckets=buckets,
                    fingerprints=fingerprints,
                    bucket_names_by_rank=names_by_rank,
                    log_probs=log_probs,
                    loss=stats["train/loss"],
                    grad_norm=stats["train/grad_norm"],
                    weights=be.named_weights(),
                    lr=be.current_lr,
                )
                if kind == "llama" and name == "tp2_mb4":  # saved at TP=2 after one step, then a second step
                    be.save_distributed(ckpt)
                    be.train(ref["batch"], _algo())
                    results["ckpt_tp2_step2"] = be.named_weights()
                if kind == "llama" and name == "cp2_mb4":  # saved at CP=2 (two replicas of every shard)
                    be.save_distributed(os.path.join(out_dir, "ckpt_cp2"))
                parallel_state.destroy_model_parallel()
        if ("llama", "cp2_mb4") in results:  # the CP=2 checkpoint at DP=2
            be = backend(refs["llama"], 1, 1, 1)
            be.load_distributed(os.path.join(out_dir, "ckpt_cp2"))
            results["ckpt_cp2_loaded_at_dp2"] = be.named_weights()
            parallel_state.destroy_model_parallel()
        # Loaded at TP=1 (DP=2): the weights, then a second step that needs the resharded optimizer state.
        be = backend(refs["llama"], 1, 1, 1)
        be.load_distributed(ckpt)
        results["ckpt_tp1_loaded"] = be.named_weights()
        be.train(refs["llama"]["batch"], _algo())
        results["ckpt_tp1_step2"] = be.named_weights()
        parallel_state.destroy_model_parallel()
        be = backend(refs["llama"], 1, 2, 4)  # and at PP=2
        be.load_distributed(ckpt)
        results["ckpt_pp2_loaded"] = be.named_weights()
        refusals = []
        for call, arg in ((be.load_distributed, os.path.join(out_dir, "uncommitted")), (be.save_distributed, ckpt)):
            try:
                call(arg)
            except (FileNotFoundError, FileExistsError) as exc:
                refusals.append(type(exc).__name__)
        results["ckpt_refusals"] = refusals
        # the checkpoint NaN guard of a sharded trainer: a NaN in rank 1's shard is seen by rank 0 too
        results["finite_before"] = be.all_ranks_finite()
        if rank == 1:
            with torch.no_grad():
                next(be.model.parameters()).view(-1)[0] = float("nan")
        results["finite_after"] = be.all_ranks_finite()
        parallel_state.destroy_model_parallel()
        results["vocab_parallel"] = _vocab_parallel_check(
            rank, torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        )
        destroy_parallel_state()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


def _run_layouts(out_dir: str, device_type: str):
    import torch.multiprocessing as mp

    refs = {kind: _reference(kind) for kind in LAYOUTS}
    mp.spawn(_rank_main, args=(2, free_port("127.0.0.1"), refs, out_dir, device_type), nprocs=2, join=True)
    return refs, torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    """One 2-process gloo run of every layout of both models (process start and imports dominate the time)."""
    return _run_layouts(str(tmp_path_factory.mktemp("megatron_parallel")), "cpu")


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_parallel_layouts_equal_single_rank(kind, parallel_run):
    _check_layouts(kind, *parallel_run)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_parallel_layouts_on_two_gpus(tmp_path):
    """The same layouts on 2 GPUs with NCCL (fp32, TF32 off): Megatron's CUDA paths without any shim."""
    refs, results = _run_layouts(str(tmp_path), "cuda")
    for kind in LAYOUTS:
        _check_layouts(kind, refs, results, atol=1e-4, rel=1e-4)
    test_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2((refs, results))


def _check_layouts(kind: str, refs: dict, results: dict, atol: float = 2e-5, rel: float = 1e-5) -> None:
    ref = refs[kind]
    mask = ref["batch"].response_mask > 0
    for name, *_layout in LAYOUTS[kind]:
        got = results[(kind, name)]
        # Export (TP shards gathered, PP stages with their layer offsets) gives back the HF tensors exactly.
        assert set(got["exported"]) == set(ref["state"]), name
        for key, expected in ref["state"].items():
            assert torch.equal(got["exported"][key], expected), f"{kind} {name} export {key}"
        # The streamed export: the same tensors, in buckets within the byte budget (a larger tensor alone), the
        # same buckets on every rank (each stage's buckets broadcast over the pipeline group).
        buckets = got["buckets"]
        assert len(buckets) > 2 and got["bucket_names_by_rank"][0] == got["bucket_names_by_rank"][1], name
        assert all(len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= BUCKET_BYTES for b in buckets)
        streamed = [(n, t) for b in buckets for n, t in b]
        assert sorted(n for n, _ in streamed) == sorted(ref["state"]), name
        for key, tensor in streamed:
            assert torch.equal(tensor, ref["state"][key]), f"{kind} {name} streamed {key}"
        # Parity fingerprints streamed from the device buckets equal those of the reference's tensors cast alike.
        assert got["fingerprints"] == checksums({k: v.to(torch.bfloat16) for k, v in ref["state"].items()}), name
        torch.testing.assert_close(
            got["log_probs"][mask],
            ref["log_probs"][mask],
            rtol=0,
            atol=atol,
            msg=lambda m: f"{kind} {name} log-probs: {m}",
        )
        assert got["loss"] == pytest.approx(ref["loss"], rel=rel, abs=1e-7), name
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rel), name
        assert got["lr"] == LR
        assert set(got["weights"]) == set(ref["updated"]), name
        # One Adam step moves each weight by ~lr * sign(grad); an element whose grad is ~Adam's eps (1e-8) moves
        # by a fraction of that, which round-off can change: 10% of lr tolerates that, a wrong or missing
        # update (>= lr) fails. The grad norm above checks the gradient's scale.
        for key, expected in ref["updated"].items():
            torch.testing.assert_close(
                got["weights"][key], expected, rtol=0, atol=0.1 * LR, msg=lambda m: f"{kind} {name} {key}: {m}"
            )


def test_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2(parallel_run):
    _refs, results = parallel_run
    saved = results[("llama", "tp2_mb4")]["weights"]
    for key, expected in saved.items():
        assert torch.equal(results["ckpt_tp1_loaded"][key], expected), key
        assert torch.equal(results["ckpt_pp2_loaded"][key], expected), key
    for key, expected in results[("llama", "cp2_mb4")]["weights"].items():  # saved at CP=2, loaded at DP=2
        assert torch.equal(results["ckpt_cp2_loaded_at_dp2"][key], expected), key
    # No commit marker: not a checkpoint. A committed checkpoint is never overwritten.
    assert results["ckpt_refusals"] == ["FileNotFoundError", "FileExistsError"]
    # The second step from the loaded state (Adam moments resharded from TP=2 to TP=1) equals the TP=2 run's.
    for key, expected in results["ckpt_tp2_step2"].items():
        torch.testing.assert_close(
            results["ckpt_tp1_step2"][key], expected, rtol=0, atol=0.1 * LR, msg=lambda m: f"second step {key}: {m}"
        )
    moved = max(float((results["ckpt_tp2_step2"][k] - saved[k]).abs().max()) for k in saved)
    assert moved > 0.5 * LR  # the second step did update the weights


def test_every_rank_learns_of_a_nan_in_any_rank_shard(parallel_run):
    """The guard before a distributed checkpoint: all ranks refuse together (no rank waits in the save alone)."""
    results = parallel_run[1]
    assert results["finite_before"] is True and results["finite_after"] is False


def test_vocab_parallel_equals_one_rank(parallel_run):
    """Rank 0's shard of the TP=2 computation against the full-vocabulary one-rank computation."""
    from rollflow.tasks.train.megatron.vocab_parallel import vocab_parallel_log_probs

    got = parallel_run[1]["vocab_parallel"]
    full = got["logits"].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(full, got["target"], vocab_start=0, vocab_size=70, temperature=0.7)
    (lp * got["w_lp"] + ent * got["w_ent"]).sum().backward()
    torch.testing.assert_close(got["lp"], lp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got["ent"], ent.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got["grad"], full.grad[..., :40], rtol=0, atol=1e-12)


def test_full_recompute_runs_in_train_mode_and_changes_nothing():
    """Megatron's full recompute reruns each layer's forward in backward, only in train mode (the old backend
    trained in eval(), which silently turned it off); the step is the same with and without it."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.settings import OptimConfig
    from tests.megatron_cpu_shim import cpu_megatron

    ref = _reference("llama")
    outcome = {}
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}):
        optim = OptimConfig(
            backend="megatron",
            device="cpu",
            dtype="float32",
            lr=LR,
            num_steps_per_rollout=1,
            micro_batch_size=4,
            megatron={"layer_spec": "sdpa", "optimizer": "torch", **recompute},
        )
        with cpu_megatron():
            be = MegatronBackend(ref["config"], ref["state"], optim, keep_ref=False)
            calls = []
            be.model.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
            stats = be.train(ref["batch"], _algo())
        outcome[bool(recompute)] = (stats["train/loss"], stats["train/grad_norm"], len(calls))
    assert outcome[False][2] == 2 and outcome[True][2] == 4  # 2 micro-batches; recomputed once each in backward
    assert outcome[True][:2] == outcome[False][:2]
    assert outcome[False][1] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_lr_warmup_follows_megatrons_scheduler():
    """Megatron's OptimizerParamScheduler drives the LR: linear warmup from 0 over lr_warmup_steps optimizer steps
    (as in Megatron-LM, the first step runs at the warmup's start value)."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.settings import OptimConfig
    from tests.megatron_cpu_shim import cpu_megatron

    ref = _reference("llama")
    optim = OptimConfig(
        backend="megatron",
        device="cpu",
        dtype="float32",
        lr=LR,
        num_steps_per_rollout=2,
        micro_batch_size=4,
        megatron={"layer_spec": "sdpa", "optimizer": "megatron", "lr_warmup_steps": 4},
    )
    with cpu_megatron():
        be = MegatronBackend(ref["config"], ref["state"], optim, keep_ref=False)
        lrs = [be.current_lr]
        steps: list[dict] = []
        be.train(ref["batch"], _algo(), on_step=steps.append)
        lrs.append(be.current_lr)
        with pytest.raises(ValueError, match=r"train\.megatron\.lr_warmup_steps needs optimizer='megatron'"):
            MegatronBackend(
                ref["config"],
                ref["state"],
                optim.model_copy(update={"megatron": optim.megatron.model_copy(update={"optimizer": "torch"})}),
                keep_ref=False,
            )
    assert len(steps) == 2 and all(s["skipped"] == 0 for s in steps)
    assert lrs == [0.0, pytest.approx(LR * 2 / 4)]


def test_packed_micro_batches_hold_only_real_tokens():
    """packing='thd': each micro-batch is its rows' real tokens end to end ([1, sum of lengths], positions
    restarting per row, cu_seqlens at the row bounds); every attention call sees one row; the log-probs equal the
    HF reference's. A token budget counts real tokens, not rows x longest row."""
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.process import destroy_parallel_state
    from rollflow.tasks.train.megatron.schedule import token_budget_micro_batches
    from rollflow.tasks.train.settings import OptimConfig
    from tests.megatron_cpu_shim import cpu_megatron

    ref = _reference("llama")
    batch = ref["batch"]
    lengths = batch.attention_mask.sum(dim=1).tolist()
    optim = OptimConfig(
        backend="megatron",
        device="cpu",
        dtype="float32",
        lr=LR,
        num_steps_per_rollout=1,
        micro_batch_size=4,
        megatron={"layer_spec": "sdpa", "optimizer": "megatron", "packing": "thd"},
    )
    with cpu_megatron():
        be = MegatronBackend(ref["config"], ref["state"], optim, keep_ref=False)
        try:
            items = be._model_inputs(batch, be._micro_batches(batch))
            seen: list[int] = []
            attention = be.model.decoder.layers[0].self_attention.core_attention
            original = attention._sdpa
            attention._sdpa = lambda q, k, v: (seen.append(q.shape[2]), original(q, k, v))[1]
            log_probs = be.compute_log_probs(batch)
        finally:
            destroy_parallel_state()
    assert [tuple(i.tokens.shape) for i in items] == [(1, sum(lengths[:4])), (1, sum(lengths[4:]))]
    first = items[0]
    assert first.packed.cu_seqlens_q.tolist() == [0] + torch.tensor(lengths[:4]).cumsum(0).tolist()
    assert first.position_ids[0, : lengths[0] + 2].tolist() == list(range(lengths[0])) + [0, 1]
    assert seen == lengths  # one causal attention per row, of the row's own length
    mask = batch.response_mask > 0
    torch.testing.assert_close(log_probs[mask], ref["log_probs"][mask], rtol=0, atol=2e-5)
    # budget: rows are added while their real tokens fit (padded: rows x the longest row would)
    budget = lengths[0] + lengths[1]
    packed = token_budget_micro_batches(batch, budget, packed=True)
    assert packed[0].size == 2 and all(int(m.attention_mask.sum()) <= budget or m.size == 1 for m in packed)
    assert sum(m.size for m in packed) == batch.size


def test_packing_needs_an_attention_that_reads_packed_rows():
    from pydantic import ValidationError

    from rollflow.tasks.train.settings import MegatronSettings

    with pytest.raises(ValidationError, match=r"packing='thd' needs .* layer_spec 'sdpa'"):
        MegatronSettings(packing="thd", layer_spec="local")
