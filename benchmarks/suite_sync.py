"""Suite 5: weight sync trainer -> engine, bytes/s per available path vs a plain copy of the same bytes.

Paths:
- in-process `update_weights`: `TorchBackend.named_weights()` (a CPU copy) into `HFEngine.update_weights`
  (what a colocated worker does; on GPU the bytes go device -> host -> device);
- Ray actor -> actor: the trainer actor's `named_weights` ObjectRef handed to the engine actor's
  `update_weights` (the `sync` task of `rl_iteration`), CPU box only (no Ray on the GPU box);
- device to device (GPU): the trainer's resident tensors (`TorchBackend.weight_tensors()`, no copy) handed
  to `update_weights`, which copies them with one multi-tensor copy (`torch._foreach_copy_`).
Baselines: one flat tensor of the same byte count copied on the same device (`dst.copy_(src)`), and on
GPU also a flat device -> host -> device round trip (the fair baseline for host staging).
The parity check that follows every sync in `rl_iteration` (per-tensor fingerprints computed where the
weights live, both sides: tasks/sync/parity.py) is timed too: it is part of the sync task's cost.
Goals (issue 23): device to device >= 50% of the plain device copy; parity check <= 0.5 s at 0.5B on GPU. Issue 37:
device-to-device sync + parity check <= 2 s for a 7B shape (`--sync-shape qwen2.5-7b`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import time

import torch

from benchmarks.core import BenchContext, Goal, SuiteResult, sync_device
from benchmarks.models import param_count, qwen2, save_model_dir, state_bytes

TITLE = "weight sync trainer -> engine"
D2D_GOAL = Goal(">=", 0.5, ">= 50% of device copy")
PARITY_GOAL = Goal("<=", 0.5, "<= 0.5 s at 0.5B")
SHA_MAX_BYTES = 2 << 30
SYNC_7B_GOAL = Goal("<=", 2.0, "<= 2 s at 7B (issue 37)")


def params_for(ctx: BenchContext) -> dict:
    if ctx.device.startswith("cuda"):
        return dict(shape="qwen2-0.5b", dtype="bfloat16")
    return dict(shape="cpu-small" if ctx.quick else "cpu-sync", dtype="float32")


def run(ctx: BenchContext) -> SuiteResult:
    from rollflow.tasks.rollout.hf_engine import HFEngine
    from rollflow.tasks.sync.parity import checksums, compare
    from rollflow.tasks.train.settings import OptimConfig
    from rollflow.tasks.train.torch_backend import TorchBackend

    res = SuiteResult("sync", TITLE)
    p = params_for(ctx)
    p.update(ctx.options.get("sync", {}))
    repeats = ctx.n(5, 3)
    cuda = ctx.device.startswith("cuda")
    dev = ctx.device
    backend = TorchBackend(
        qwen2(p["shape"], dtype=p["dtype"], device=dev, seed=1),
        OptimConfig(dtype=p["dtype"], device=dev, threads=torch.get_num_threads()),
        keep_ref=False,
    )
    engine = HFEngine(qwen2(p["shape"], dtype=p["dtype"], device=dev, seed=2), pad_token_id=0, eos_token_id=2)
    n_bytes = state_bytes(backend.model.state_dict())
    res.params = {
        **p,
        "repeats": repeats,
        "device": dev,
        "params": param_count(backend.model),
        "bytes": n_bytes,
        "tensors": len(backend.model.state_dict()),
    }
    version = itertools.count(1)

    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)

    def plain_copy() -> None:
        dst.copy_(src)

    def in_process() -> None:
        engine.update_weights(backend.named_weights(), next(version))

    def device_to_device() -> None:
        engine.update_weights(backend.weight_tensors(), next(version))

    def host_round_trip() -> None:
        dst.copy_(src.cpu())

    def time_it(fn) -> float:
        sync_device(dev)
        start = time.perf_counter()
        fn()
        sync_device(dev)
        return time.perf_counter() - start

    paths = {"in-process update_weights" + (" (host staging)" if cuda else ""): in_process}
    if cuda:
        paths["device-to-device update_weights"] = device_to_device
    baselines = {"plain copy": plain_copy}
    if cuda:
        baselines["plain host round trip"] = host_round_trip
    for fn in [*paths.values(), *baselines.values()]:
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in [*paths, *baselines]}
    for _ in range(repeats):
        for name, fn in [*paths.items(), *baselines.items()]:
            times[name].append(time_it(fn))
    assert compare(checksums(backend.named_weights()), checksums(engine.named_weights())).ok

    ray_times: list[float] = []
    if ctx.services is not None and importlib.util.find_spec("ray") is not None and not cuda:
        ray_times = _ray_path(ctx, res, backend.model, repeats)
    elif not cuda:
        res.unavailable["ray actor -> actor"] = "needs Ray and the benchmark services (CPU command)"
    else:
        res.unavailable["ray actor -> actor"] = "Ray is not installed on the GPU box"
    if ray_times:
        times["ray actor -> actor"] = ray_times

    gbps = {name: [n_bytes / t / 1e9 for t in ts] for name, ts in times.items()}
    for name, values in gbps.items():
        res.add(f"{name} GB/s", "GB/s", values)
    for name in [*paths, *(["ray actor -> actor"] if ray_times else [])]:
        base = "plain copy"
        goal = D2D_GOAL if name.startswith("device-to-device") else None
        res.ratio(f"{name} / {base}", [a / b for a, b in zip(gbps[name], gbps[base])], goal=goal)
    if cuda:
        staging = next(n for n in paths if "host staging" in n)
        res.ratio(
            f"{staging} / plain host round trip", [a / b for a, b in zip(gbps[staging], gbps["plain host round trip"])]
        )

    def parity_check() -> None:
        assert compare(checksums(backend.weight_tensors()), checksums(engine.weight_tensors())).ok

    parity_check()  # warm-up (index ramps, kernels)
    check_s = [time_it(parity_check) for _ in range(max(1, repeats // 2))]
    res.add(
        "parity check (both sides) s",
        "s",
        check_s,
        goal=PARITY_GOAL if cuda and p["shape"] == "qwen2-0.5b" else None,
        note="fingerprints of every tensor on both sides, where the weights live, as rl_iteration's sync "
        "task does after each update",
    )
    if n_bytes > SHA_MAX_BYTES:
        res.unavailable["sha256 of host copies (both sides) s"] = (
            f"skipped above {SHA_MAX_BYTES >> 30} GiB (minutes of sha256 on the host, for a comparison only)"
        )
    else:
        res.add(
            "sha256 of host copies (both sides) s",
            "s",
            [
                time_it(
                    lambda: [
                        hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()
                        for side in (backend.named_weights(), engine.named_weights())
                        for v in side.values()
                    ]
                )
            ],
            note="the check before issue 23, for comparison: copy to host, sha256 per tensor",
        )
    res.add(
        "sync + parity check GB/s",
        "GB/s",
        [n_bytes / (t + c) / 1e9 for t, c in zip(times[next(iter(paths))], itertools.cycle(check_s))],
        note="in-process update_weights plus the parity check",
    )
    if cuda:
        d2d = times["device-to-device update_weights"]
        res.add(
            "device-to-device sync + parity check s",
            "s",
            [t + c for t, c in zip(d2d, itertools.cycle(check_s))],
            goal=SYNC_7B_GOAL if p["shape"] == "qwen2.5-7b" else None,
            note="what a colocated sync costs where the engine takes the trainer's device tensors",
        )
    del backend, engine, src, dst
    if cuda:
        torch.cuda.empty_cache()
    return res


def _ray_path(ctx: BenchContext, res: SuiteResult, model, repeats: int) -> list[float]:
    from rollflow.infra.clients import EngineClient, TrainerClient
    from rollflow.infra.workers import start_actor, stop_actor
    from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
    from rollflow.tasks.train.worker import TrainWorker

    ctx.services.ray()
    model_dir = save_model_dir(model, ctx.workdir / "sync-model")
    run_name = "bench-sync"
    threads = torch.get_num_threads()
    start = time.perf_counter()
    trainer = TrainerClient(
        [
            start_actor(
                run_name,
                "trainer",
                TrainWorker,
                str(model_dir),
                OptimConfig(threads=threads, compute_ref_log_probs=False),
                AlgoConfig(),
                store_root=str(ctx.workdir / "sync-store"),
                run=run_name,
            )
        ]
    )
    engine = EngineClient(
        start_actor(run_name, "engine", RolloutWorker, str(model_dir), RolloutConfig(threads=threads), DataConfig())
    )
    res.add("ray actors start (trainer + engine)", "s", [time.perf_counter() - start])
    try:
        version = itertools.count(1)
        engine.update_weights(trainer.named_weights(), next(version))  # warm-up
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.update_weights(trainer.named_weights(), next(version))
            out.append(time.perf_counter() - t0)
        if engine.weight_checksums() != trainer.weight_checksums():
            res.notes.append("ray path: engine weights differ from the trainer's after the sync")
        return out
    finally:
        stop_actor(run_name, "engine")
        stop_actor(run_name, "trainer")
