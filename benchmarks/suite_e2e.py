"""Suite 10: the whole RL iteration, end to end, on one device (issue 37), needing neither Ray nor Prefect.

The rollout worker (hf engine) and the train worker (megatron backend when megatron-core imports, else torch)
are colocated in this process with offload on, and driven stage by stage as `rl_iteration` drives its actors
(benchmarks/e2e_iteration.py): generate -> reward -> persist -> load -> train -> weight sync -> parity, with the
engine's release / resume and the trainer's onload / offload in between. Random-init Qwen2 shapes built from a
config (benchmarks/models.py), bf16 on CUDA; `tiny` is the demo's built-in model (CPU, seconds).

    python -m benchmarks --suite e2e --shape 1.5b          # one CUDA GPU
    bash scripts/e2e_gpu.sh                                # 0.5b, 1.5b and the largest shape that fits

Where Ray is installed (the CPU box; not the GPU box of docs/performance.md) the same iterations run a second
time with both workers as Ray actors behind rl_iteration's typed clients (on CUDA each takes half the GPU, as
`placement=colocate` places them; not run on a GPU yet): `ray:` figures, paired with the in-process ones by
rollout id, say what Ray adds; the train metrics of each pair are compared (the same work).

Figures: seconds per stage; generated tokens per second per GPU over the whole iteration (NeMo-RL's
convention); peak GPU memory (CUDA); overhead = iteration time - generate - train, as a share of the
iteration; the first iteration (compilation, allocator warm-up) against the median steady one. Goals: overhead
<= 5% and parity <= 0.2 s at 1.5B, first iteration <= 1.5x steady.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import resource
import statistics
import sys
import time
import traceback

import torch

from benchmarks.core import BenchContext, Goal, SuiteResult
from benchmarks.e2e_iteration import (
    STAGES,
    IterationTimes,
    Setup,
    build_ray_workers,
    build_workers,
    run_iteration,
    stop_ray_workers,
)
from benchmarks.models import param_count, qwen2, save_model_dir
from rollflow.tasks.compile_cache import cached_roles
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, resolve_hf_weight_sync
from rollflow.tasks.train.memory_fit import TrainerDoesNotFit, check_trainer_fits
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig

TITLE = "end-to-end iteration, colocated, offload on"
OVERHEAD_GOAL = Goal("<=", 0.05, "<= 5% (goal at 1.5B)")
PARITY_GOAL = Goal("<=", 0.2, "<= 0.2 s (goal at 1.5B)")
FIRST_GOAL = Goal("<=", 1.5, "<= 1.5x steady")
GPUS = 1  # engine and trainer share one device

# --shape -> benchmarks/models.py shape; tiny is the built-in model of the demo.
SHAPES = {
    "tiny": "builtin:addition",
    "small": "cpu-small",  # the GPU shapes' path (a Qwen2 saved as a local directory) at a size a CPU runs
    "0.5b": "qwen2-0.5b",
    "1.5b": "qwen2-1.5b",
    "3b": "qwen2.5-3b",
    "5b": "qwen2.5-7b-20l",
    # Qwen2.5-7B's shape: its trainer state (~18 bytes per parameter with Megatron's optimizer) exceeds an 80 GB GPU,
    # which the fit check (tasks/train/memory_fit.py) refuses before anything is built
    "7b": "qwen2.5-7b",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int
    samples_per_prompt: int
    new_tokens: int
    micro_batch: int
    steps: int  # optimizer steps per rollout


def workload(shape: str, quick: bool) -> Workload:
    if shape == "tiny":  # the built-in model's context is 64 positions
        return Workload(prompts=8, samples_per_prompt=8, new_tokens=8, micro_batch=64, steps=1)
    if quick:
        return Workload(prompts=16, samples_per_prompt=8, new_tokens=128, micro_batch=8, steps=1)
    return Workload(prompts=64, samples_per_prompt=8, new_tokens=512, micro_batch=8, steps=1)


def default_shape(device: str) -> str:
    return "0.5b" if device.startswith("cuda") else "tiny"


def train_backend(chosen: list[str] | None) -> tuple[str, str]:
    """The first of --train-backends when given; else megatron when megatron-core imports, else torch; and why."""
    if chosen:
        return chosen[0], "chosen with --train-backends"
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return "megatron", "megatron-core is installed"
    return "torch", "megatron-core is not installed here: the torch backend ran instead"


def model_path(ctx: BenchContext, shape: str, dtype: str) -> str:
    """The built-in model, or a random-init Qwen2 of the shape saved as a local HF directory both workers load."""
    spec = SHAPES[shape]
    if spec.startswith("builtin:"):
        return spec
    model = qwen2(spec, dtype=dtype, device=ctx.device, seed=0)
    path = save_model_dir(model, ctx.workdir / f"e2e-{shape}")
    del model
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(path)


def make_setup(ctx: BenchContext, shape: str, load: Workload, backend: str, model: str, dtype: str) -> Setup:
    threads = torch.get_num_threads()
    rollout = RolloutConfig(
        n_samples_per_prompt=load.samples_per_prompt,
        max_new_tokens=load.new_tokens,
        dtype=dtype,
        device=ctx.device,
        threads=threads,
        # as RunConfig resolves auto: the suite's workers are colocated
        hf_weight_sync=resolve_hf_weight_sync(ctx.options.get("e2e_weight_sync", "auto"), ctx.device, "colocate"),
    )
    optim = OptimConfig(
        backend=backend,
        num_steps_per_rollout=load.steps,
        micro_batch_size=load.micro_batch,
        dtype=dtype,
        device=ctx.device,
        threads=threads,
        lr=1e-6,
        compute_ref_log_probs=False,  # no KL term: the reference pass is off, as in a GRPO run without KL
    )
    data = DataConfig(prompts_per_rollout=load.prompts)
    store = str(ctx.workdir / f"e2e-store-{shape}")
    cache = ctx.options.get("compile_cache")
    return Setup(model, rollout, data, optim, AlgoConfig(), store, compile_cache=cache)


WEIGHT_SYNC_HOW = {
    "object_store": "the trainer's HF-named host copies into the engine's update_weights (through Ray's object store "
    "between actors)",
    "tensor": "bucket by bucket as the trainer makes them on its device: handed over directly in process, CUDA IPC "
    "handles between actors (flows/weight_sync/tensor.py)",
}


def run(ctx: BenchContext) -> SuiteResult:
    res = SuiteResult("e2e", TITLE)
    cuda = ctx.device.startswith("cuda")
    shape = ctx.options.get("e2e_shape") or default_shape(ctx.device)
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is not one of {', '.join(SHAPES)}")
    load = workload(shape, ctx.quick)
    steady = ctx.n(3, 2)
    backend, why = train_backend(ctx.options.get("train_backends"))
    dtype = "bfloat16" if cuda else "float32"
    setup = make_setup(ctx, shape, load, backend, SHAPES[shape], dtype)
    if not SHAPES[shape].startswith("builtin:"):
        # The trainer worker checks this too, but only after the model is built, saved and the engine loaded it.
        try:
            check_trainer_fits(
                param_count(qwen2(SHAPES[shape], device="meta")),
                setup.optim,
                parks_on_host=True,
                engine_host_bytes_per_param=setup.engine_host_bytes_per_param,
            )
        except TrainerDoesNotFit as exc:
            print(f"[e2e] {shape}: {exc}", file=sys.stderr, flush=True)
            res.params = {"shape": shape, "model": SHAPES[shape], "dtype": dtype, "train_backend": backend}
            res.error = f"{type(exc).__name__}: {exc}"
            return res
    setup = dataclasses.replace(setup, model=model_path(ctx, shape, dtype))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cached = cached_roles(setup.compile_cache)  # what the workers load (before they write their own)
    started = time.perf_counter()
    workers = build_workers(setup)
    startup_s = time.perf_counter() - started
    startup_peak = torch.cuda.max_memory_allocated() if cuda else None
    res.params = {
        "shape": shape,
        "model": SHAPES[shape],
        "params": param_count(workers.engine.engine.model),
        "dtype": dtype,
        "device": ctx.device,
        "gpus": GPUS,
        "train_backend": workers.trainer.describe().backend,
        "train_backend_why": why,
        "engine": "hf",
        "placement": "colocate",
        "offload": True,
        "weight_sync": setup.weight_sync,
        "weight_sync_how": WEIGHT_SYNC_HOW[setup.weight_sync],
        "compile_cache": setup.compile_cache,
        "compile_cache_found": cached,
        **dataclasses.asdict(load),
        "steady_iterations": steady,
        "threads": torch.get_num_threads(),
        "stages": list(STAGES),
    }
    runs: list[IterationTimes] = []
    res.data = {"startup_s": startup_s, "iterations": []}
    if cuda:
        res.data["startup_peak_bytes"] = startup_peak
    try:
        for rollout_id in range(1 + steady):
            runs.append(run_iteration(workers, rollout_id, ctx.device))
            res.data["iterations"].append(runs[-1].to_dict())
            print(f"[e2e] {shape} iteration {rollout_id}: {runs[-1].iteration_s:.2f} s", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - a shape that does not fit keeps its startup and finished iterations
        traceback.print_exc()
        res.error = str(exc)
        return res
    add_figures(res, runs, startup_s, cuda)
    del workers
    if cuda:
        torch.cuda.empty_cache()
    run_on_ray(ctx, res, dataclasses.replace(setup, store_root=setup.store_root + "-ray"), runs)
    res.notes += [
        "generate = the rollout call (tokenize, batched generate, Sample building); train = train_on_artifact "
        "(batch from the artifact's columns, old log-probs, advantages, optimizer steps); overhead = everything "
        "else between the iteration's first and last device synchronisation",
        "goals are set for one H200 at 1.5B; at other shapes (and on CPU) pass/miss is for reference only",
        "checkpoint and eval stages are not part of the measured iteration",
    ]
    if not cuda:
        res.notes.append("CPU: offload / onload move nothing (the weights are already in host memory)")
        if backend == "megatron":
            res.notes.append("CPU: train.megatron.optimizer=auto is torch AdamW here (Megatron's optimizer on CUDA)")
    print_stage_table(res.params, runs, file=sys.stderr)
    return res


def run_on_ray(ctx: BenchContext, res: SuiteResult, setup: Setup, local: list[IterationTimes]) -> None:
    """The same iterations (same rollout ids, a store of their own) with the two workers as Ray actors behind
    rl_iteration's clients; figures prefixed `ray:`, paired with the in-process ones by rollout id."""
    if importlib.util.find_spec("ray") is None or ctx.services is None:
        res.unavailable["ray: iteration s (steady)"] = "Ray is not installed here: the in-process iterations only"
        return
    ctx.services.ray()
    started = time.perf_counter()
    try:
        workers = build_ray_workers(setup, ctx.device.startswith("cuda"))
        startup_s = time.perf_counter() - started
        runs = [run_iteration(workers, it.rollout_id, ctx.device) for it in local]
    except Exception as exc:  # noqa: BLE001 - the in-process figures stand without the Ray ones
        traceback.print_exc()
        res.notes.append(f"ray: failed: {exc}")
        return
    finally:
        stop_ray_workers()
    res.data["ray"] = {"startup_s": startup_s, "iterations": [r.to_dict() for r in runs]}
    pairs = list(zip(local[1:], runs[1:]))
    res.add("ray: startup s (actors built)", "s", [startup_s])
    res.add("ray: iteration s (steady)", "s", [r.iteration_s for _, r in pairs])
    res.add(
        "ray: added s per iteration (steady)",
        "s",
        [r.iteration_s - i.iteration_s for i, r in pairs],
        note="the Ray iteration minus the in-process one of the same rollout id",
    )
    res.ratio("ray / in-process iteration (steady)", [r.iteration_s / i.iteration_s for i, r in pairs])
    res.ratio(
        "ray: overhead share", [r.overhead_s() / r.iteration_s for _, r in pairs], unit="fraction", goal=OVERHEAD_GOAL
    )
    for stage in ("generate", "train", "sync", "parity"):
        res.add(f"ray: {stage} s", "s", [r.seconds[stage] for _, r in pairs])
    same = all(i.train_metrics == r.train_metrics for i, r in zip(local, runs))
    res.notes.append(
        "ray: train metrics "
        + ("identical to the in-process iterations' (the same work)" if same else "DIFFER from the in-process ones")
    )


def add_figures(res: SuiteResult, runs: list[IterationTimes], startup_s: float, cuda: bool) -> None:
    first, steady = runs[0], runs[1:]
    steady_s = [r.iteration_s for r in steady]
    res.add("iteration s (steady)", "s", steady_s)
    res.add("iteration s (first)", "s", [first.iteration_s], note="compilation and allocator warm-up included")
    res.ratio("first / steady iteration", [first.iteration_s / statistics.median(steady_s)], goal=FIRST_GOAL)
    res.add(
        "generated tokens/s per GPU",
        "tokens/s",
        [r.generated_tokens / r.iteration_s / GPUS for r in steady],
        note="response tokens of the rollout over the whole iteration's time (NeMo-RL's convention)",
    )
    res.ratio(
        "overhead share",
        [r.overhead_s() / r.iteration_s for r in steady],
        goal=OVERHEAD_GOAL,
        unit="fraction",
        note="(iteration - generate - train) / iteration",
    )
    res.add("overhead s", "s", [r.overhead_s() for r in steady])
    for stage in STAGES:
        values = [r.seconds[stage] for r in steady]
        if stage == "parity":
            res.add("parity s", "s", values, goal=PARITY_GOAL, note="fingerprints of every tensor, both sides")
        else:
            res.add(f"{stage} s", "s", values)
    res.add("startup s (engine + trainer built)", "s", [startup_s])
    # Offload parks the trainer's state in pinned host memory: what the process held at most, startup included
    # (ru_maxrss is in KiB on Linux).
    res.add("peak host memory GiB (process)", "GiB", [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20])
    if cuda:
        # Every iteration, the first included: as in rl_train, the trainer is still resident during its generate.
        res.add(
            "peak GPU memory GiB",
            "GiB",
            [max(r.peak_bytes.values()) / 2**30 for r in runs],
            note="one value per iteration, the first included",
        )
        for label, group in (("first iteration", [first]), ("steady iterations", steady)):
            peaks = {stage: max(r.peak_bytes[stage] for r in group) / 2**30 for stage in STAGES}
            top = max(peaks, key=peaks.__getitem__)
            res.notes.append(f"peak GPU memory of the {label}: {peaks[top]:.1f} GiB, in stage {top}")


def print_stage_table(params: dict, runs: list[IterationTimes], file=sys.stdout) -> None:
    """Plain text (no rich on a bare GPU box): one row per stage, the first and the median steady iteration."""
    steady = runs[1:]
    print(f"e2e {params['shape']} ({params['train_backend']} trainer, {params['device']}):", file=file)
    print(f"  {'stage':24s} {'first s':>9s} {'steady s':>9s} {'share':>7s}", file=file)
    med_iter = statistics.median(r.iteration_s for r in steady)
    for stage in STAGES:
        med = statistics.median(r.seconds[stage] for r in steady)
        print(f"  {stage:24s} {runs[0].seconds[stage]:9.3f} {med:9.3f} {med / med_iter:7.1%}", file=file)
    print(f"  {'iteration':24s} {runs[0].iteration_s:9.3f} {med_iter:9.3f}", file=file)
    tokens = statistics.median(r.generated_tokens / r.iteration_s / GPUS for r in steady)
    overhead = statistics.median(r.overhead_s() / r.iteration_s for r in steady)
    print(f"  generated tokens/s per GPU {tokens:.0f}, overhead {overhead:.1%}", file=file)
