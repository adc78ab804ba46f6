"""The cost of rollout.logprobs='teacher_forced': hf engine generate time with vs without the rescoring pass.

    # CPU, writes benchmarks/results/<cpu>-teacher-forced-<date>.json
    python benchmarks/teacher_forced_logprobs.py
    python benchmarks/teacher_forced_logprobs.py --device cuda --out $OUT/tf.json

What is timed: `HFEngine.generate` on the same requests, seed and model, once with log-probs taken while
sampling (`engine`) and once followed by the trainer's teacher-forced forward over the whole call
(`teacher_forced`, tasks/model/teacher_forced.py). Repeats alternate the two, and the figure is the
paired ratio teacher_forced / engine (only ratios: absolute times on a shared box say little). Cases:

- demo: the built-in addition model and the demo's rollout (256 prompts x 8 samples, 5 new tokens);
- long: a 4-layer Qwen2 (hidden 256, vocab 4096) from config, 64 prompts x 4 samples, 32-token prompts,
  64 new tokens: generation dominates more when responses are long, so the extra forward costs less.

The trainer's micro-batch size is RunConfig's default (256 rows). Also reported: the largest
|generation-time - teacher-forced| log-prob gap over the timed samples (what the option removes).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.core import (  # noqa: E402
    SuiteResult,
    print_report,
    ratios,
    report_header,
    sync_device,
    write_json,
)

TITLE = "rollout.logprobs='teacher_forced': generate time vs engine log-probs (paired ratio)"


def cases() -> dict[str, dict]:
    return {
        "demo": dict(model="builtin:addition", prompts=256, n=8, new_tokens=5, prompt_len=None),
        "long": dict(model="cpu-small", prompts=64, n=4, new_tokens=64, prompt_len=32),
    }


def _engine_inputs(case: dict, dtype: str, device: str):
    """(model, pad id, eos id, prompt token lists) of one case."""
    from rollflow.tasks.model.dtypes import DTYPES

    if case["model"].startswith("builtin:"):
        from rollflow.tasks.model.source import resolve_model_path
        from rollflow.tasks.model.tiny import load_model
        from rollflow.tasks.model.tokenizer import load_tokenizer, prompt_token_ids
        from rollflow.tasks.rollout.settings import DataConfig, prompts_for

        path = resolve_model_path(case["model"])
        tok = load_tokenizer(path)
        model = load_model(path, dtype=DTYPES[dtype], device=device)
        prompts = [
            prompt_token_ids(tok, it.prompt) for it in prompts_for(DataConfig(prompts_per_rollout=case["prompts"]), 0)
        ]
        return model, tok.pad_token_id, tok.eos_token_id, prompts
    from benchmarks.models import SHAPES, qwen2, random_prompts

    model = qwen2(case["model"], dtype=dtype, device=device, max_positions=case["prompt_len"] + case["new_tokens"] + 64)
    prompts = random_prompts(case["prompts"], case["prompt_len"], SHAPES[case["model"]]["vocab_size"], seed=1)
    return model, 0, 2, prompts


def run_case(
    res: SuiteResult,
    name: str,
    case: dict,
    *,
    dtype: str,
    device: str,
    repeats: int,
    micro_batch_size: int,
    threads: int,
) -> None:
    from rollflow.tasks.model.teacher_forced import ScoringLayout
    from rollflow.tasks.rollout.engine import GenerationRequest, SamplingParams
    from rollflow.tasks.rollout.hf_engine import HFEngine

    model, pad, eos, prompts = _engine_inputs(case, dtype, device)
    layout = ScoringLayout(micro_batch_size=micro_batch_size, threads=threads, dtype=dtype, device=device)
    engines = {
        "engine": HFEngine(model, pad_token_id=pad, eos_token_id=eos),
        "teacher_forced": HFEngine(model, pad_token_id=pad, eos_token_id=eos, scoring=layout),
    }
    requests = [GenerationRequest(prompt_ids=p, n=case["n"]) for p in prompts]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=case["new_tokens"], seed=1234)
    outs: dict[str, list] = {}

    gaps: list[float] = []
    digests: dict[str, set[str]] = {}
    same = True

    def timed(mode: str) -> float:
        sync_device(device)
        start = time.perf_counter()
        outs[mode] = engines[mode].generate(requests, params)
        sync_device(device)
        return time.perf_counter() - start

    def compare() -> None:
        """The gap between the two modes' log-probs of the same (same-seed) samples, per repeat."""
        nonlocal same
        pairs = [(a, b) for ga, gb in zip(outs["engine"], outs["teacher_forced"]) for a, b in zip(ga, gb)]
        same = same and all(a.response_ids == b.response_ids for a, b in pairs)
        gaps.append(max(abs(x - y) for a, b in pairs for x, y in zip(a.log_probs, b.log_probs)))
        for mode in engines:  # which numerics each mode produced (the same in every process, if deterministic)
            digests.setdefault(mode, set()).add(_digest(outs[mode]))

    for mode in engines:  # warm-up (on CUDA the static-cache decode step compiles here)
        timed(mode)
    seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    for i in range(repeats):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))  # alternate: no order bias
        for mode in order:
            seconds[mode].append(timed(mode))
        compare()
    n_samples = len(prompts) * case["n"]
    tokens = sum(len(o.response_ids) for group in outs["engine"] for o in group)
    what = (
        f"{len(prompts)} prompts x {case['n']}, {case['new_tokens']} new tokens, {tokens} response tokens, "
        f"{dtype} {device}"
    )
    res.ratio(
        f"{name}: teacher_forced / engine generate time",
        ratios(seconds["teacher_forced"], seconds["engine"]),
        note=f"{what}; paired per repeat",
    )
    # A shared box's load changes between the two calls of a pair; the fastest call of each mode is
    # the least disturbed one.
    res.ratio(
        f"{name}: best teacher_forced / best engine",
        [min(seconds["teacher_forced"]) / min(seconds["engine"])],
        note="fastest of the repeats of each mode",
    )
    res.add(f"{name}: engine generate time", "s", seconds["engine"])
    res.add(
        f"{name}: max |engine - teacher-forced| log-prob",
        "nats",
        gaps,
        note="per repeat: what the option removes (the same tokens sampled: " + ("yes" if same else "NO") + ")",
    )
    res.params[name] = {
        **case,
        "samples": n_samples,
        "log_prob_sha256": {mode: sorted(d) for mode, d in digests.items()},
    }


def _digest(groups: list) -> str:
    import hashlib
    import struct

    values = [x for group in groups for out in group for x in out.log_probs]
    return hashlib.sha256(struct.pack(f"{len(values)}d", *values)).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (RunConfig's default: 1)")
    ap.add_argument("--micro-batch-size", type=int, default=256, help="train.micro_batch_size (default 256)")
    ap.add_argument("--case", action="append", default=None, help="demo, long (default: both)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-table", action="store_true")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    torch.set_num_threads(max(1, args.threads))
    res = SuiteResult("teacher_forced", TITLE)
    res.params.update(
        device=args.device,
        dtype=dtype,
        repeats=args.repeats,
        threads=args.threads,
        micro_batch_size=args.micro_batch_size,
    )
    started = time.perf_counter()
    chosen = cases()
    for name in args.case or list(chosen):
        print(f"[bench] teacher_forced {name} ...", file=sys.stderr, flush=True)
        run_case(
            res,
            name,
            chosen[name],
            dtype=dtype,
            device=args.device,
            repeats=args.repeats,
            micro_batch_size=args.micro_batch_size,
            threads=args.threads,
        )
    res.elapsed_s = time.perf_counter() - started
    prefix = "cpu" if not args.device.startswith("cuda") else "gpu"
    out = args.out or (
        Path(__file__).resolve().parent / "results" / f"{prefix}-teacher-forced-{_dt.date.today().isoformat()}.json"
    )
    command = "python benchmarks/teacher_forced_logprobs.py " + " ".join(argv or sys.argv[1:])
    report = report_header(command, args.device, quick=False)
    report["suites"]["teacher_forced"] = res.to_dict()
    report["elapsed_s"] = round(res.elapsed_s, 1)
    write_json(report, out)
    if not args.no_table:
        print_report(report)
    print(f"wrote {out} ({res.elapsed_s:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
