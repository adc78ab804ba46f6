"""Suite 3: rollout throughput (tokens/s) of each available engine vs plain `model.generate`.

The baseline is `model.generate` with the default dynamic KV cache on the same model, batch, prompt
length and sampling settings (temperature 1, full softmax). The `hf` engine runs with its defaults:
on CUDA that is its own decode loop over transformers' static cache (tasks/rollout/static_decode.py:
the compiled one-token step of `generate`, Gumbel-max sampling, no per-token host synchronisation).
Tokens counted: batch x decode steps (the work done, the same for every candidate).
"""

from __future__ import annotations

import importlib.util
import time

import torch

from benchmarks.core import BenchContext, Goal, SuiteResult, ratios, sync_device
from benchmarks.models import SHAPES, qwen2, random_prompts

TITLE = "rollout throughput: engines vs model.generate (dynamic cache)"


def params_for(ctx: BenchContext) -> dict:
    if ctx.device.startswith("cuda"):
        return dict(shape="qwen2-0.5b", dtype="bfloat16", batch=256, prompt_len=128, new_tokens=256)
    if ctx.quick:
        return dict(shape="cpu-tiny", dtype="float32", batch=16, prompt_len=16, new_tokens=16)
    return dict(shape="cpu-small", dtype="float32", batch=64, prompt_len=32, new_tokens=64)


def run(ctx: BenchContext) -> SuiteResult:
    from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
    from rollflow.tasks.rollout.hf_engine import HFEngine

    res = SuiteResult("rollout", TITLE)
    p = params_for(ctx)
    p.update(ctx.options.get("rollout", {}))
    repeats = ctx.n(3, 2)
    res.params = {
        **p,
        "repeats": repeats,
        "device": ctx.device,
        "sampling": "temperature 1, top_k 0, top_p 1",
        "threads": torch.get_num_threads(),
    }
    cuda = ctx.device.startswith("cuda")
    model = qwen2(
        p["shape"], dtype=p["dtype"], device=ctx.device, max_positions=max(4096, p["prompt_len"] + p["new_tokens"] + 64)
    )
    vocab = SHAPES[p["shape"]]["vocab_size"]
    prompts = random_prompts(p["batch"], p["prompt_len"], vocab, seed=1)
    ids = torch.tensor(prompts, device=ctx.device)
    mask = torch.ones_like(ids)
    seed = 1234

    def plain(cache_implementation: str | None):
        def fn() -> int:
            torch.manual_seed(seed)
            extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=p["new_tokens"],
                eos_token_id=2,
                pad_token_id=0,
                **extra,
            )
            return p["batch"] * (out.shape[1] - p["prompt_len"])

        return fn

    last_outputs: dict[int, list] = {}

    def engine_fn(engine: HFEngine):
        requests = [GenerationRequest(prompt_ids=pr, n=1) for pr in prompts]
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=p["new_tokens"], seed=seed)

        def fn() -> int:
            outs = engine.generate(requests, params)
            last_outputs[id(engine)] = [group[0] for group in outs]
            steps = max(len(group[0].response_ids) for group in outs)
            return p["batch"] * steps

        return fn

    # name -> (callable, warm-up calls). The baseline first: every ratio divides by it.
    candidates: dict[str, tuple] = {"generate (dynamic cache)": (plain(None), 1)}
    engine = HFEngine(model, pad_token_id=0, eos_token_id=2, max_batch_size=4096)
    engines = {}
    hf_name = "hf engine (static cache, compiled)" if engine.uses_static_cache else "hf engine (dynamic cache)"
    # The compiled engine pays torch.compile in its first calls: measured from the third call on.
    candidates[hf_name] = (engine_fn(engine), 2 if engine.uses_static_cache else 1)
    engines[hf_name] = engine
    if cuda and not ctx.quick:
        dyn = HFEngine(model, pad_token_id=0, eos_token_id=2, static_cache=False)
        engines["hf engine (dynamic cache)"] = dyn
        candidates["hf engine (dynamic cache)"] = (engine_fn(dyn), 0)  # same shapes as the baseline's warm-up
        candidates["generate (static cache)"] = (plain("static"), 1)
    if importlib.util.find_spec("sglang") is None:
        res.unavailable["sglang engine"] = "sglang is not installed (CUDA-only wheels; docs/sglang.md)"

    warmups: dict[str, list[float]] = {}
    for name, (fn, warm) in candidates.items():
        for _ in range(warm):
            sync_device(ctx.device)
            start = time.perf_counter()
            fn()
            sync_device(ctx.device)
            warmups.setdefault(name, []).append(time.perf_counter() - start)
    tps: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, (fn, _warm) in candidates.items():
            sync_device(ctx.device)
            start = time.perf_counter()
            tokens = fn()
            sync_device(ctx.device)
            tps[name].append(tokens / (time.perf_counter() - start))

    base = "generate (dynamic cache)"
    for name in candidates:
        res.add(f"{name} tokens/s", "tokens/s", tps[name])
    goal = Goal(">=", 2.5, ">= 2.5x") if cuda else None
    limit = (
        ""
        if cuda
        else (
            "CPU: transformers compiles the static-cache decode step only on CUDA, so the engine "
            "is generate + log-probs here"
        )
    )
    fig = res.ratio(
        f"{hf_name} / {base}", ratios(tps[hf_name], tps[base]), goal=goal, limit=limit, note="paired per repeat"
    )
    if cuda and "generate (static cache)" in tps:
        fig.limit = static_limit(tps[hf_name], tps["generate (static cache)"], tps[base])
    for name in candidates:
        if name not in (base, hf_name):
            res.ratio(f"{name} / {base}", ratios(tps[name], tps[base]))
    if cuda and "generate (static cache)" in tps:
        res.ratio(
            f"{hf_name} / generate (static cache)",
            ratios(tps[hf_name], tps["generate (static cache)"]),
            goal=Goal(">=", 1.0, ">= transformers' static generate"),
            note="paired per repeat",
        )
    for name, seconds in warmups.items():
        if "compiled" in name:
            res.add(
                f"{name} warm-up calls",
                "s",
                seconds,
                note="one value per warm-up call, in order: the first ones pay torch.compile",
            )
    # Correctness of what was timed: engine log-probs vs a teacher-forced forward of the same tokens.
    for name, eng in engines.items():
        outs = last_outputs.get(id(eng))
        if outs:
            res.add(
                f"{name} |rollout - teacher-forced log-prob|",
                "nats",
                [_logprob_gap(model, prompts, outs)],
                note=f"mean over the first 8 samples' response tokens, {p['dtype']}",
            )
    if cuda:
        res.notes.append(f"max GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del engine, candidates, model
    if cuda:
        torch.cuda.empty_cache()
    return res


def static_limit(engine: list[float], plain_static: list[float], dynamic: list[float]) -> str:
    """What bounds the engine's speed-up, from the same run's figures."""
    import statistics as st

    lib = st.median(ratios(plain_static, dynamic))
    own = st.median(ratios(engine, plain_static))
    return (
        f"transformers' own static-cache generate reaches {lib:.2f}x the dynamic cache in the same run; the "
        f"engine (its own decode loop: tasks/rollout/static_decode.py) runs at {own:.2f}x of it"
    )


@torch.no_grad()
def _logprob_gap(model, prompts: list[list[int]], outs: list, rows: int = 8) -> float:
    device = next(model.parameters()).device
    gaps = []
    for prompt, out in list(zip(prompts, outs))[:rows]:
        if not out.response_ids:
            continue
        ids = torch.tensor([prompt + list(out.response_ids)], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        gaps.append((lp.cpu() - torch.tensor(out.log_probs)).abs().mean().item())
    return sum(gaps) / max(1, len(gaps))
