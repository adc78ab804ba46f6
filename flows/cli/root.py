"""The `rollflow` app: the flow commands (demo, train, rollout, replay), `config`, `warmstart`, and the
command groups of the sibling modules. Parses arguments, builds a RunConfig, calls a flow or a tool."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List, Optional

import typer

from rollflow.flows.cli import align, bench, bisect, drill, services, tools
from rollflow.flows.cli.common import (
    ConfigOpt,
    SetOpt,
    build_config,
    console,
    ensure_prefect_api,
    err_console,
    fail,
    public,
    quiet_prefect_console,
    take_traceback_flag,
    user_errors,
)
from rollflow.flows.prefect_ops.naming import run_tags
from rollflow.tasks.rollout.sglang.flags import CLI_PREFIX, rewrite_cli_args

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="RL post-training as Prefect flows, with slime's debug toolkit built in.",
)

SubmitOpt = typer.Option(
    False,
    "--submit",
    help="create the run through its deployment (served by `rollflow worker` "
    "or a work pool) instead of running it here; prints its UI URL",
)
WatchOpt = typer.Option(False, "--watch", help="with --submit: follow the run until it ends (exit 1 unless Completed)")


@app.callback()
def _options(
    traceback: bool = typer.Option(
        False,
        "--traceback",
        help="print the full traceback of an error (it always goes to a log file; the error "
        "line names it); accepted anywhere on the command line",
    ),
) -> None:
    if traceback:
        os.environ["ROLLFLOW_TRACEBACK"] = "1"


def preflight(cfg, command: str, **kwargs) -> None:
    """Inputs checked before Prefect, Ray or any actor starts (flows/preflight.py); one line, exit 2."""
    from rollflow.flows.preflight import preflight as check  # lazy: keeps torch/prefect out of CLI start-up

    check(cfg, command, **kwargs)


def run_training(cfg) -> dict:
    preflight(cfg, "train")
    quiet_prefect_console()
    api = ensure_prefect_api()
    from rollflow.flows.progress import iteration_progress  # lazy: keeps torch/prefect out of CLI start-up
    from rollflow.flows.train import rl_train

    console.print(
        f"run [bold]{cfg.run}[/]: {cfg.iterations} iterations, artifacts under "
        f"{public(cfg.store.root)}/{cfg.run}; Prefect UI at {api.removesuffix('/api')}"
    )
    from prefect import tags

    from rollflow.flows.prefect_ops.submit import RETRY_DELAY_S

    flow = rl_train.with_options(retries=cfg.retries, retry_delay_seconds=RETRY_DELAY_S, timeout_seconds=cfg.timeout_s)
    with iteration_progress(console), tags(*run_tags(cfg.run, "train")):
        summary = flow(cfg)
    return summary


def print_summary(cfg, summary: dict) -> None:
    from rollflow.flows.reporting import run_file  # lazy: keeps torch/prefect out of CLI start-up

    console.print_json(json.dumps(summary))
    if summary.get("first_reward") is not None:
        console.print(
            f"mean reward: first iteration {summary['first_reward']:.3f} -> last iteration {summary['last_reward']:.3f}"
        )
    for name in ("metrics.jsonl", "reward_curve.png"):
        console.print(f"{name}: {run_file(cfg, name)[1]}")


@app.command()
def demo(
    iterations: int = typer.Option(12, min=1),
    run: Optional[str] = typer.Option(None, help="run name"),
    root: str = typer.Option("runs", help="artifact root"),
    sets: Optional[List[str]] = SetOpt,
) -> None:
    """GRPO on the built-in addition task with the tiny warm-started model (CPU, a few minutes)."""
    threads = max(1, min(4, os.cpu_count() or 1))
    base = {
        "run": run or time.strftime("demo-%Y%m%d-%H%M%S"),
        "iterations": iterations,
        "eval_every": 4,
        "store": {"root": root},
        "rollout": {"threads": threads},
        "train": {"threads": threads},
    }
    cfg = build_config(None, sets, base)
    with user_errors("demo"):
        summary = run_training(cfg)
    print_summary(cfg, summary)


@app.command()
def train(
    config: Optional[str] = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    resume_from: Optional[int] = typer.Option(
        None,
        "--resume-from",
        min=0,
        help="resume after this committed checkpoint instead of the latest "
        "(e.g. when the latest one's payload is corrupt)",
    ),
    submit: bool = SubmitOpt,
    watch: bool = WatchOpt,
) -> None:
    """Run (or resume) an RL training run: `rl_train` with the given RunConfig."""
    extra = [f"resume_from={resume_from}"] if resume_from is not None else []
    cfg = build_config(config, [*(sets or []), *extra])
    if cfg.debug.rollout_only or cfg.debug.train_only:
        fail("debug.rollout_only / debug.train_only: use `rollflow rollout` or `rollflow replay`")
    if submit:
        with user_errors("train"):
            preflight(cfg, "train")
            submit_run(cfg, "rl_train", "train", watch)
        return
    with user_errors("train"):
        summary = run_training(cfg)
    print_summary(cfg, summary)


def run_flow(cfg, flow_fn, command: str, preflight_kwargs: dict | None = None, **kwargs) -> dict:
    preflight(cfg, command, **(preflight_kwargs or {}))
    quiet_prefect_console()
    api = ensure_prefect_api()
    from rollflow.flows.progress import iteration_progress  # lazy: keeps torch/prefect out of CLI start-up

    # the flows (rollout_only, replay_train) log cfg.notices as warnings, which the console shows
    console.print(
        f"run [bold]{cfg.run}[/], artifacts under {public(cfg.store.root)}/{cfg.run}; "
        f"Prefect UI at {api.removesuffix('/api')}"
    )
    from prefect import tags

    with iteration_progress(console), tags(*run_tags(cfg.run, command)):
        return flow_fn(cfg, **kwargs)


def submit_run(cfg, flow_name: str, mode: str, watch: bool, **flow_params) -> None:
    """The same run as the local command, created through `flow_name`'s deployment (the UI's "Run" call)."""
    # lazy: keeps torch/prefect out of CLI start-up
    from rollflow.flows.params import params_of
    from rollflow.flows.prefect_ops.submit import RUN_POLICY_FIELDS, refused_fields, submit
    from rollflow.flows.prefect_ops.submit import watch as follow

    for line in refused_fields(flow_name, cfg):
        fail(line)
    policy = {field: getattr(cfg, field) for field in RUN_POLICY_FIELDS.get(flow_name, ())}
    api = ensure_prefect_api()
    params = {"params": params_of(flow_name, cfg), **{k: v for k, v in flow_params.items() if v is not None}}
    try:
        run = submit(flow_name, params, api, tags=run_tags(cfg.run, mode), **policy)
    except LookupError as exc:
        fail(str(exc))
    console.print(f"submitted {run.deployment} as flow run {run.name} ({run.id}): {run.url}")
    if watch:
        final = follow(run.id, lambda name: console.print(f"  {name}"))
        if final != "Completed":
            raise typer.Exit(1)


def ids_option(spec: Optional[str]) -> Optional[list[int]]:
    from rollflow.flows.preflight import parse_ids  # lazy: keeps torch/prefect out of CLI start-up

    try:
        return parse_ids(spec)
    except ValueError as exc:
        fail(str(exc))


@app.command()
def rollout(
    config: Optional[str] = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    ids: Optional[str] = typer.Option(None, help="rollout ids: 3, 0,2,5 or 0-4 (default 0..iterations-1)"),
    checkpoint: Optional[int] = typer.Option(None, help="engine weights from this run's checkpoint N"),
    save_debug_rollout_data: Optional[str] = typer.Option(
        None, help="also export slime .pt files: template with {rollout_id}"
    ),
    submit: bool = SubmitOpt,
    watch: bool = WatchOpt,
) -> None:
    """Rollout only (slime --debug-rollout-only): engines generate and persist artifacts; no trainer."""
    extra = ["debug.rollout_only=true"]
    if save_debug_rollout_data:
        extra.append(f"debug.save_debug_rollout_data={save_debug_rollout_data}")
    cfg = build_config(config, [*(sets or []), *extra])
    rollout_ids = ids_option(ids)
    if submit:
        with user_errors("rollout"):
            preflight(cfg, "rollout")
            submit_run(
                cfg,
                "rollout_only",
                "rollout",
                watch,
                rollout_ids=rollout_ids,
                checkpoint=checkpoint,
                save_debug_rollout_data=cfg.debug.save_debug_rollout_data,
            )
        return
    with user_errors("rollout"):
        result = run_flow(cfg, _flow("rollout_only"), "rollout", rollout_ids=rollout_ids, checkpoint=checkpoint)
    console.print_json(json.dumps(result))


@app.command()
def replay(
    config: Optional[str] = ConfigOpt,
    sets: Optional[List[str]] = SetOpt,
    ids: Optional[str] = typer.Option(None, help="pinned rollout ids: 3, 0,2,5 or 0-4 (default: all)"),
    source_run: Optional[str] = typer.Option(None, help="run whose artifacts to replay (default: --set run)"),
    load_debug_rollout_data: Optional[str] = typer.Option(
        None, "--load-debug-rollout-data", help="replay slime .pt dumps: template with {rollout_id}"
    ),
    subsample: Optional[float] = typer.Option(None, help="keep this fraction of prompt groups"),
    dump_details: Optional[str] = typer.Option(None, help="write per-token train dumps under this folder"),
    no_cache: bool = typer.Option(False, "--no-cache", help="train even if an identical replay is cached"),
    import_run: Optional[str] = typer.Option(
        None,
        "--import-run",
        help="import the slime dumps into this (new) run instead of --set run: for a "
        "changed dump whose rollout id that run already imported",
    ),
    stage: Optional[str] = typer.Option(
        None,
        "--stage",
        help="reward|advantage|loss|all: recompute that stage of --source-run on its pinned "
        "rollouts and compare with its recorded values (exit 1 on a mismatch)",
    ),
    submit: bool = SubmitOpt,
    watch: bool = WatchOpt,
) -> None:
    """Replay training (slime --debug-train-only): train on pinned rollouts; no engine is started.
    With --stage: stage replay with expected values instead (docs/checks.md)."""
    if stage is not None:
        if submit or load_debug_rollout_data or import_run or subsample is not None or dump_details:
            fail(
                "--stage compares a committed run with its recorded values: drop --submit, "
                "--load-debug-rollout-data, --import-run, --subsample and --dump-details"
            )
        cfg = build_config(config, sets)
        with user_errors("replay"):
            from rollflow.flows.cli import stage as stage_cli  # lazy: keeps torch/prefect out of CLI start-up

            stage_cli.run(cfg, stage, ids_option(ids), source_run)
        return
    extra = ["debug.train_only=true"]
    for key, value in (
        ("load_debug_rollout_data", load_debug_rollout_data),
        ("load_debug_rollout_data_subsample", subsample),
        ("dump_details", dump_details),
    ):
        if value is not None:
            extra.append(f"debug.{key}={value}")
    cfg = build_config(config, [*(sets or []), *extra])
    rollout_ids = ids_option(ids)
    if import_run is not None and not load_debug_rollout_data and not cfg.debug.load_debug_rollout_data:
        fail("--import-run names the run that slime dumps are imported into: it needs --load-debug-rollout-data")
    if source_run is not None and (load_debug_rollout_data or cfg.debug.load_debug_rollout_data):
        fail(
            "--source-run replays a run's committed rollouts and --load-debug-rollout-data replays slime dumps: "
            "drop one of them"
        )
    kwargs = {"import_run": import_run} if import_run is not None else {}
    if submit:
        if import_run is not None:
            fail("--import-run is a local replay option; drop --submit or --import-run")
        with user_errors("replay"):
            preflight(cfg, "replay", rollout_ids=rollout_ids, source_run=source_run)
            submit_run(
                cfg,
                "replay_train",
                "replay",
                watch,
                rollout_ids=rollout_ids,
                source_run=source_run,
                load_debug_rollout_data=cfg.debug.load_debug_rollout_data,
                subsample=cfg.debug.load_debug_rollout_data_subsample,
                dump_details=cfg.debug.dump_details,
                use_cache=not no_cache,
            )
        return
    with user_errors("replay"):
        result = run_flow(
            cfg,
            _flow("replay_train"),
            "replay",
            preflight_kwargs={"rollout_ids": rollout_ids, "source_run": source_run},
            rollout_ids=rollout_ids,
            source_run=source_run,
            use_cache=not no_cache,
            **kwargs,
        )
    console.print_json(json.dumps(result))


def _flow(name: str):
    import rollflow.flows.debug as debug  # lazy: keeps torch/prefect out of CLI start-up

    return getattr(debug, name)


@app.command("config")
def show_config(config: Optional[str] = ConfigOpt, sets: Optional[List[str]] = SetOpt) -> None:
    """Print the validated RunConfig (every field with its value) as JSON."""
    cfg = build_config(config, sets)
    console.print_json(cfg.model_dump_json())


@app.command()
def warmstart(
    out: str = typer.Option("tasks/model/builtin/addition-sft", help="output model directory"),
    target_accuracy: float = typer.Option(0.30),
    seed: int = typer.Option(0),
) -> None:
    """Rebuild the built-in tiny model: SFT on addition until held-out greedy accuracy >= target."""
    from rollflow.tasks.recipes.sft import warm_start  # lazy: keeps torch/prefect out of CLI start-up

    result = warm_start(out, target_accuracy=target_accuracy, seed=seed, eval_every=20, log=console.print)
    console.print(f"saved {out}: {result.steps} steps, {result.seconds:.0f}s, accuracy {result.accuracy:.3f}")


# The command modules share flows/cli/common.py and never import this module: no import circle.
services.register(app)
tools.register(app)
align.register(app)
bisect.register(app)
bench.register(app)
drill.register(app)


def main() -> None:
    sys.argv[1:] = take_traceback_flag(sys.argv[1:])
    if any(arg.startswith(CLI_PREFIX) for arg in sys.argv[1:]):
        try:  # --sglang-<flag>[=value] -> --set rollout.sglang.args.<flag>=value (checked against SGLang's flags)
            sys.argv[1:] = rewrite_cli_args(sys.argv[1:])
        except ValueError as exc:
            try:
                fail(str(exc))
            except typer.Exit as done:
                sys.exit(done.exit_code)
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted; committed artifacts and checkpoints are kept, run again to resume")
        sys.exit(130)
