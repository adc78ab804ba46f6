"""`python -m benchmarks`: run suites, print one table, write one JSON file."""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.core import BenchContext, default_out, print_report, report_header, write_json

# Canonical order: replay quotes the orchestration suite's iteration when both run.
SUITES = {
    "orchestration": "benchmarks.suite_orchestration",
    "artifact_io": "benchmarks.suite_artifact_io",
    "rollout": "benchmarks.suite_rollout",
    "train": "benchmarks.suite_train",
    "sync": "benchmarks.suite_sync",
    "replay": "benchmarks.suite_replay",
    "async": "benchmarks.suite_async",
    "watchdog": "benchmarks.watchdog_cost",
    "cluster": "benchmarks.suite_cluster",
    "e2e": "benchmarks.suite_e2e",
}
ALIASES = {
    "1": "orchestration",
    "2": "artifact_io",
    "3": "rollout",
    "4": "train",
    "5": "sync",
    "6": "replay",
    "7": "async",
    "8": "watchdog",
    "9": "cluster",
    "10": "e2e",
    "end-to-end": "e2e",
    "watchdog_cost": "watchdog",
    "artifacts": "artifact_io",
    "io": "artifact_io",
    "artifact-io": "artifact_io",
    "overhead": "orchestration",
}
GPU_SUITES = ("rollout", "train", "sync")  # need neither Prefect nor Ray


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument(
        "--suite",
        "-s",
        action="append",
        default=None,
        metavar="NAME",
        help=f"suite to run (repeatable; default: all on CPU, {', '.join(GPU_SUITES)} on CUDA): "
        f"{', '.join(SUITES)} or 1-10",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and fewer repeats (a smoke run)")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/<cpu|gpu name>-<date>.json)"
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default per suite)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument(
        "--train-backends",
        default=None,
        help="comma list for the train suite (default torch,megatron); the e2e suite trains with the first "
        "(default megatron when installed, else torch)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on CPU (default 1, as RunConfig's rollout.threads / train.threads)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder, removed)")
    ap.add_argument(
        "--shape",
        default=None,
        help="e2e suite: model shape, tiny (the built-in model) | small | 0.5b | 1.5b | 3b | 5b (default: 0.5b on "
        "CUDA, tiny on CPU)",
    )
    ap.add_argument(
        "--weight-sync",
        choices=("auto", "object_store", "tensor"),
        default=None,
        help="e2e suite: the hf engine's weight sync (rollout.hf_weight_sync; default auto: tensor on CUDA, "
        "object_store on CPU)",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="e2e suite: a folder (any fsspec URL) of torch.compile's caches, loaded before the workers compile and "
        "written after their first compiled work (store.compile_cache); a second run on a fresh node then starts warm",
    )
    ap.add_argument(
        "--sync-shape",
        default=None,
        help="sync suite: a benchmarks/models.py shape, e.g. qwen2.5-7b (default: qwen2-0.5b on CUDA)",
    )
    ap.add_argument("--no-table", action="store_true", help="skip the rich table (the JSON is still written)")
    ap.add_argument(
        "--cluster-state",
        default=None,
        help="the cluster suite measures this cluster (`python -m rollflow.infra.cluster up --state-dir DIR`) "
        "instead of bringing one up and down",
    )
    return ap.parse_args(argv)


def resolve_suites(names: list[str] | None, device: str) -> list[str]:
    if not names:
        return list(GPU_SUITES) if device.startswith("cuda") else list(SUITES)
    chosen = []
    for raw in names:
        for name in raw.split(","):
            key = ALIASES.get(name.strip().lower(), name.strip().lower())
            if key not in SUITES:
                raise SystemExit(f"unknown suite {name!r}; choose from {', '.join(SUITES)} (or 1-10)")
            if key not in chosen:
                chosen.append(key)
    if "replay" in chosen and "orchestration" in chosen:  # replay quotes orchestration's iteration
        chosen.remove("replay")
        chosen.append("replay")
    return chosen


def resolve_device(spec: str) -> str:
    if spec != "auto":
        return spec
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Before anything imports Prefect: its settings are read once per process.
    from benchmarks.services import Services, isolate_env

    isolate_env(workdir)
    device = resolve_device(args.device)
    suites = resolve_suites(args.suite, device)
    if not device.startswith("cuda"):
        import torch

        torch.set_num_threads(max(1, args.threads))
    ctx = BenchContext(
        quick=args.quick, repeats=args.repeats, workdir=workdir, device=device, services=Services(workdir)
    )
    if args.cluster_state:
        ctx.options["cluster_state"] = args.cluster_state
    if args.shape:
        ctx.options["e2e_shape"] = args.shape
    if args.compile_cache:
        ctx.options["compile_cache"] = args.compile_cache
    if args.weight_sync:
        ctx.options["e2e_weight_sync"] = args.weight_sync
    if args.sync_shape:
        from benchmarks.models import SHAPES

        if args.sync_shape not in SHAPES:
            raise SystemExit(f"--sync-shape {args.sync_shape!r} is not a model shape; choose from {', '.join(SHAPES)}")
        ctx.options["sync"] = {"shape": args.sync_shape}
    if args.train_backends:
        ctx.options["train_backends"] = [b.strip() for b in args.train_backends.split(",") if b.strip()]
    started = time.perf_counter()
    out = args.out or default_out(device)
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    report = report_header(command, device, quick=args.quick)
    try:
        for name in suites:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            module = importlib.import_module(SUITES[name])
            try:
                result = module.run(ctx)
            except Exception as exc:  # noqa: BLE001 - one failing suite must not lose the others
                from benchmarks.core import SuiteResult

                result = SuiteResult(name, getattr(module, "TITLE", name))
                result.error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            result.elapsed_s = time.perf_counter() - t0
            ctx.results[name] = result
            report["suites"][name] = result.to_dict()
            write_json(report, out)  # after every suite: a run cut short keeps what it measured
            print(f"[bench] {name} done in {result.elapsed_s:.0f}s", file=sys.stderr, flush=True)
    finally:
        ctx.services.close()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(report, out)
    if not args.no_table:
        print_report(report)
    print(f"wrote {out} ({report['elapsed_s']:.0f} s)")
    return 1 if any(s.get("error") for s in report["suites"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
