"""GPU checks of the megatron backend (issue 6), runnable with torch + transformers + a few wheels
(scripts/use_checkout.sh), rollflow uninstalled.

    python benchmarks/gpu_checks.py --out $OUT            # scripts/gpu_checks.sh runs it on the H200

1. Log-prob parity: one Llama-shaped model, the same weights loaded into HF (torch backend) and into
   Megatron (through tasks/sync/megatron_names.py); response-token log-probs compared in fp32 (conversion
   exactness) and bf16 (max / mean abs diff, bf16 tolerance), per Megatron layer spec.
2. One train iteration through `rollflow.tasks.train.step.train_on_samples` with the megatron backend on a fixed
   rollout: step-1 `rollout/log_probs_equal_ref == 1`, `rollout/kl == 0`, `train/ppo_kl == 0`; then the
   HF-named export synced into an HF engine model passes `rollflow.tasks.sync.parity.compare`, and a checkpoint
   round trip reproduces the log-probs. Per optimizer (Megatron's, and torch AdamW on fp32 masters).

Writes gpu_checks.json (every figure) under --out; prints a summary last. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollflow.artifacts.sample import Sample  # noqa: E402
from rollflow.tasks.sync.parity import checksums, compare  # noqa: E402
from rollflow.tasks.train.batch import batch_from_samples  # noqa: E402
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig  # noqa: E402
from rollflow.tasks.train.step import train_on_samples  # noqa: E402
from rollflow.tasks.train.torch_backend import TorchBackend  # noqa: E402

BF16_MAX_TOL = 0.5  # bf16 forward of a 8-layer model, log-probs around -10: rounding-level differences
BF16_MEAN_TOL = 0.03
FP32_MAX_TOL = 2e-3
DEVICE = "cuda"  # --device cpu: a smoke test of this script (sdpa spec, torch optimizer only)
SETTINGS: dict = {}  # --settings: extra train.megatron settings for every megatron backend built here


def llama_config(
    vocab: int = 32000,
    hidden: int = 1024,
    layers: int = 8,
    heads: int = 16,
    kv_heads: int = 4,
    ffn: int = 2816,
    max_pos: int = 4096,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def hf_model(config, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init leaves norms at 1: perturb them so a norm swap in the conversion would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def fixed_samples(vocab: int, *, n: int = 16, group: int = 4, seed: int = 7) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(16, 96, (1,), generator=g))
        rlen = int(torch.randint(24, 320, (1,), generator=g))
        tokens = torch.randint(3, vocab, (plen + rlen,), generator=g).tolist()
        mask = [1] * rlen
        if i % 5 == 0:
            mask[rlen // 2 : rlen // 2 + 7] = [0] * 7  # tool-output style holes in the loss mask
        out.append(
            Sample(
                group_index=i // group,
                index=i,
                prompt=f"p{i // group}",
                tokens=tokens,
                response="",
                response_length=rlen,
                loss_mask=mask,
                rollout_log_probs=[-10.0] * rlen,
                reward=float(torch.rand(1, generator=g) > 0.5),
            )
        )
    return out


def optim_config(backend: str, dtype: str, **megatron) -> OptimConfig:
    megatron = {**SETTINGS, **megatron} if backend == "megatron" else {}
    return OptimConfig(
        backend=backend,
        dtype=dtype,
        device=DEVICE,
        micro_batch_size=4,
        num_steps_per_rollout=1,
        lr=1e-4,
        grad_clip=1.0,
        threads=4,
        megatron=megatron,
    )


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def diff_stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a.double() - b.double())[mask > 0].abs()
    return {
        "max_abs_diff": float(d.max()),
        "mean_abs_diff": float(d.mean()),
        "n_tokens": int(d.numel()),
        "mean_log_prob_hf": float(b.double()[mask > 0].mean()),
    }


def check_log_prob_parity(results: dict, specs: list[str]) -> None:
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = llama_config()
    samples = fixed_samples(config.vocab_size)
    batch = batch_from_samples(samples, group_size=4)
    base = hf_model(config)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    for dtype in ("float32", "bfloat16"):
        hf = TorchBackend(hf_model(config).to(DEVICE), optim_config("torch", dtype), keep_ref=False)
        hf.model.load_state_dict(state)
        ref = hf.compute_log_probs(batch)
        del hf
        free()
        for spec in specs:
            key = f"logprob_parity/{spec}/{dtype}"
            try:
                mb = MegatronBackend(
                    config, state, optim_config("megatron", dtype, layer_spec=spec, optimizer="torch"), keep_ref=False
                )
                lp = mb.compute_log_probs(batch)
                stats = diff_stats(lp, ref, batch.response_mask)
                tol_max, tol_mean = (
                    (FP32_MAX_TOL, FP32_MAX_TOL) if dtype == "float32" else (BF16_MAX_TOL, BF16_MEAN_TOL)
                )
                stats["pass"] = stats["max_abs_diff"] <= tol_max and stats["mean_abs_diff"] <= tol_mean
                stats["layer_spec"] = mb.layer_spec
                results[key] = stats
                del mb
            except Exception as exc:  # record and go on: one failing spec must not hide the others
                results[key] = {
                    "pass": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            free()
            print(key, json.dumps({k: v for k, v in results[key].items() if k != "traceback"}), flush=True)


def check_train_step(results: dict, optimizers: list[str], spec: str) -> None:
    from transformers import LlamaForCausalLM

    from rollflow.tasks.train.megatron.backend import MegatronBackend

    config = llama_config(layers=4)
    samples = fixed_samples(config.vocab_size, n=16)
    state = {k: v.detach().clone() for k, v in hf_model(config, seed=1).state_dict().items()}
    algo = AlgoConfig(advantage_estimator="grpo", eps_clip=0.2, kl_loss_coef=0.0)
    for opt in optimizers:
        key = f"train_step/{spec}/{opt}"
        out: dict = {}
        try:
            be = MegatronBackend(config, state, optim_config("megatron", "bfloat16", layer_spec=spec, optimizer=opt))
            t0 = time.perf_counter()
            res = train_on_samples(be, samples, algo, group_size=4)
            out["seconds"] = time.perf_counter() - t0
            m = res.metrics
            out["metrics"] = m
            out["log_probs_equal_ref"] = m["rollout/log_probs_equal_ref"]
            out["kl"] = m["rollout/kl"]
            out["ppo_kl"] = m["train/ppo_kl"]
            out["step1_ppo_kl"] = m["train/step1_ppo_kl"]
            out["grad_norm"] = m["train/grad_norm"]
            # Second iteration on the same samples: the policy moved, so now log_probs != ref.
            res2 = train_on_samples(be, samples, algo, group_size=4)
            out["iter2_kl"] = res2.metrics["rollout/kl"]
            out["iter2_log_probs_equal_ref"] = res2.metrics["rollout/log_probs_equal_ref"]
            # Weight sync: HF-named export into an HF "engine" model, checked by checksums.
            named = be.named_weights()
            engine = LlamaForCausalLM(config).to(torch.bfloat16)
            missing, unexpected = engine.load_state_dict(named, strict=False)
            report = compare(checksums(named), checksums(engine.state_dict()))
            out["sync_parity"] = report.to_dict()
            out["sync_missing"], out["sync_unexpected"] = list(missing), list(unexpected)
            # Engine-side log-probs from the synced weights vs the trainer's (bf16 tolerance).
            eng = TorchBackend(engine.to(DEVICE), optim_config("torch", "bfloat16"), keep_ref=False)
            batch = batch_from_samples(samples, group_size=4)
            out["synced_engine_vs_trainer"] = diff_stats(
                eng.compute_log_probs(batch), be.compute_log_probs(batch), batch.response_mask
            )
            del eng, engine
            # Checkpoint round trip into a fresh backend.
            blob = be.checkpoint_bytes()
            lp_before = be.compute_log_probs(batch)
            be2 = MegatronBackend(config, state, optim_config("megatron", "bfloat16", layer_spec=spec, optimizer=opt))
            be2.load_checkpoint_bytes(blob)
            out["checkpoint_bytes"] = len(blob)
            out["checkpoint_log_probs_equal"] = bool(torch.equal(be2.compute_log_probs(batch), lp_before))
            del be2
            out["pass"] = (
                out["log_probs_equal_ref"] == 1.0
                and out["kl"] == 0.0
                and out["ppo_kl"] == 0.0
                and out["step1_ppo_kl"] == 0.0
                and out["grad_norm"] > 0
                and report.ok
                and not missing
                and not unexpected
                and out["checkpoint_log_probs_equal"]
                and out["iter2_kl"] != 0.0
            )
            del be
        except Exception as exc:
            out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            out["pass"] = False
        free()
        results[key] = out
        brief = {k: v for k, v in out.items() if k not in ("metrics", "traceback")}
        print(key, json.dumps(brief, default=str), flush=True)


def torch_backend_reference(results: dict) -> None:
    """The torch backend on the same rollout, for side-by-side step-1 figures."""
    config = llama_config(layers=4)
    samples = fixed_samples(config.vocab_size, n=16)
    model = hf_model(config, seed=1).to(DEVICE)
    be = TorchBackend(model, optim_config("torch", "bfloat16"))
    res = train_on_samples(be, samples, AlgoConfig(), group_size=4)
    results["train_step/torch_backend_reference"] = {
        k: res.metrics[k]
        for k in (
            "rollout/log_probs_equal_ref",
            "rollout/kl",
            "train/ppo_kl",
            "train/loss",
            "train/grad_norm",
            "train/entropy_loss",
        )
    }
    del be, model
    free()


def environment() -> dict:
    import transformers

    from rollflow.tasks.train.megatron.process import have_transformer_engine, megatron_version

    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "cpu"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "megatron_core": megatron_version(),
        "transformer_engine": have_transformer_engine(),
        "device": name,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d"),
        "host_note": os.environ.get("GPU_CHECK_NOTE", ""),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--specs", default="sdpa,local")
    parser.add_argument("--optimizers", default="megatron,torch")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--settings", default="{}", help="JSON: train.megatron settings for the megatron backends")
    parser.add_argument("--parts", default="parity,train,reference")
    parser.add_argument("--name", default="gpu_checks", help="basename of the JSON / of this run's results")
    parser.add_argument("--small", action="store_true", help="small models (a smoke test of this script)")
    args = parser.parse_args(argv)
    global DEVICE, SETTINGS
    DEVICE = args.device
    SETTINGS = json.loads(args.settings)
    if args.small:
        global llama_config
        full = llama_config
        llama_config = lambda layers=2, **kw: full(vocab=500, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)  # noqa: E731
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_checks: no CUDA device; nothing to check")
        return 2
    results: dict = {"environment": environment(), "megatron_settings": SETTINGS}
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    if "parity" in parts:
        check_log_prob_parity(results, args.specs.split(","))
    if "train" in parts:
        check_train_step(results, args.optimizers.split(","), args.specs.split(",")[0])
    if "reference" in parts:
        try:
            torch_backend_reference(results)
        except Exception as exc:
            results["train_step/torch_backend_reference"] = {"error": f"{type(exc).__name__}: {exc}"}
    results["seconds"] = time.perf_counter() - t0
    checks = {k: v for k, v in results.items() if isinstance(v, dict) and "pass" in v}
    results["all_pass"] = all(v["pass"] for v in checks.values())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\n== {args.name} (megatron settings {json.dumps(SETTINGS)}) ==")
    for key, value in checks.items():
        figures = {
            k: value[k]
            for k in (
                "max_abs_diff",
                "mean_abs_diff",
                "log_probs_equal_ref",
                "kl",
                "ppo_kl",
                "step1_ppo_kl",
                "grad_norm",
                "error",
            )
            if k in value
        }
        print(f"{'PASS' if value['pass'] else 'FAIL'}  {key}  {json.dumps(figures, default=str)[:300]}")
    print(f"all_pass={results['all_pass']}  ({results['seconds']:.0f} s)")
    return 0 if results["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
