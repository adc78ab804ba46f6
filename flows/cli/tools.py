"""Inspection commands of `rollflow` (slime's debug tools): show, replay-reward, send, export-slime,
import-slime. The root app (flows/cli/root.py) calls `register(app)`; each command only parses, calls `artifacts/` or
`tasks/rollout/`, and prints.

Locations (ARTIFACT_URI) are anything `rollflow.tasks.debug.display.discover` accepts: a run
(`runs/myrun`, `s3://bucket/root/myrun`), one artifact folder, or a slime template with
`{rollout_id}`. `--split` / `--id` pick one rollout; the default is the latest train rollout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import typer

from rollflow.artifacts import RolloutStore
from rollflow.artifacts.errors import ArtifactError
from rollflow.artifacts.slime import export_slime_pt, has_rollout_id, import_slime_into_store
from rollflow.flows.cli.common import fail, plain_console
from rollflow.tasks.debug.display import (
    SelectionError,
    describe_ids,
    discover,
    filter_samples,
    ids_by_split,
    page_records,
    render_metrics,
    render_table,
    rollout_metrics,
    select_rollout,
    shorten,
    train_dump_summary,
)

REWARD_KEY_HELP = "field of dict rewards (the run's rollout.reward_key, as slime's --reward-key)"
EVAL_REWARD_KEY_HELP = "field of dict rewards of eval rollouts (rollout.eval_reward_key; default --reward-key)"
SPLIT_HELP = "train or eval (default: train if the location has train rollouts, else eval)"
ID_HELP = "rollout id (default: the latest of the split)"


# One console and one error line for every command (flows/cli/common.py).
_console = plain_console
_fail = fail


def _reward_key(split: str, reward_key: Optional[str], eval_reward_key: Optional[str]) -> Optional[str]:
    """The dict-reward field for `split`, as slime: eval rollouts use the eval key, falling back to the train key."""
    return (eval_reward_key or reward_key) if split == "eval" else reward_key


def _discover(uri: str):
    try:
        return discover(uri)
    except (ArtifactError, ValueError, FileNotFoundError) as exc:
        _fail(f"ARTIFACT_URI {uri!r}: {exc}")


def _select(found, split: Optional[str], rollout_id: Optional[int]):
    try:
        return select_rollout(found, split, rollout_id)
    except SelectionError as exc:
        _fail(str(exc))


def _load_table(item):
    try:
        return item.loader.table()
    except (ArtifactError, ValueError, FileNotFoundError) as exc:
        _fail(f"{item.loader.uri}: {exc}")


def _load_samples(item) -> list:
    try:
        return item.loader()
    except (ArtifactError, ValueError, FileNotFoundError) as exc:
        _fail(f"{item.loader.uri}: {exc}")


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False, default=str))


# ----------------------------------------------------------------------------- show


def show(
    uri: str = typer.Argument(..., metavar="URI", help="run, artifact folder or slime template with {rollout_id}"),
    split: Optional[str] = typer.Option(None, "--split", help=SPLIT_HELP),
    rollout_id: Optional[int] = typer.Option(None, "--id", help=ID_HELP, min=0),
    status: Optional[str] = typer.Option(None, "--status", help="completed | truncated | aborted | failed"),
    reward_min: Optional[float] = typer.Option(None, "--reward-min", help="keep samples with reward >= X"),
    reward_max: Optional[float] = typer.Option(None, "--reward-max", help="keep samples with reward <= X"),
    min_turns: Optional[int] = typer.Option(
        None, "--min-turns", min=0, help="keep conversations with at least N turns (multi-turn rollouts)"
    ),
    limit: int = typer.Option(20, "--limit", min=0, help="samples per page"),
    offset: int = typer.Option(0, "--offset", min=0, help="first sample of the page (after filtering)"),
    max_chars: int = typer.Option(48, "--max-chars", min=4, help="cut cell text at this many characters"),
    as_json: bool = typer.Option(False, "--json", help="one JSON document instead of tables"),
    reward_key: Optional[str] = typer.Option(None, "--reward-key", help=REWARD_KEY_HELP),
    eval_reward_key: Optional[str] = typer.Option(None, "--eval-reward-key", help=EVAL_REWARD_KEY_HELP),
) -> None:
    """Show a rollout: discovered ids, recomputed metrics, then a page of samples (filters apply)."""
    found = _discover(uri)
    item = _select(found, split, rollout_id)
    samples = _load_table(item)
    key = _reward_key(item.split, reward_key, eval_reward_key)
    metrics = rollout_metrics(samples, key)
    try:
        shown = filter_samples(
            samples, status=status, reward_min=reward_min, reward_max=reward_max, reward_key=key, min_turns=min_turns
        )
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        _echo_json(
            {
                "uri": uri,
                "ids": ids_by_split(found),
                "split": item.split,
                "rollout_id": item.rollout_id,
                "source": item.loader.uri,
                "metrics": metrics,
                "filters": {
                    "status": status,
                    "reward_min": reward_min,
                    "reward_max": reward_max,
                    "min_turns": min_turns,
                },
                "n_matching": len(shown),
                "offset": offset,
                "limit": limit,
                "samples": page_records(shown, limit, offset),
                "train_dump": train_dump_summary(item.loader),
            }
        )
        return
    console = _console()
    console.print(f"rollouts at {uri}: {describe_ids(found)}")
    console.print(f"showing {item.split} rollout {item.rollout_id} ({item.loader.uri})")
    console.print(render_metrics(metrics, title=f"metrics ({len(samples)} samples, before filters)"))
    dump = train_dump_summary(item.loader)
    if dump is not None:
        console.print(render_metrics(dump, title="train dump (--dump-details, per-token means)"))
    filters = [
        f"{k}={v}"
        for k, v in (("status", status), ("reward>=", reward_min), ("reward<=", reward_max), ("min_turns", min_turns))
        if v is not None
    ]
    first, last = min(offset + 1, len(shown)), min(offset + limit, len(shown))
    title = f"samples {first}-{last} of {len(shown)}" + (f" matching {', '.join(filters)}" if filters else "")
    console.print(render_table(shown, limit, offset, max_chars=max_chars, title=title))
    if last < len(shown):
        console.print(f"next page: --offset {offset + limit}")


# ----------------------------------------------------------------------------- replay-reward


def replay_reward_cmd(
    uri: str = typer.Argument(..., metavar="ARTIFACT_URI", help="run, artifact folder or slime template"),
    reward: str = typer.Option(..., "--reward", help="built-in name or 'pkg.module:function' (sync or async)"),
    reward_key: Optional[str] = typer.Option(None, "--reward-key", help=REWARD_KEY_HELP),
    eval_reward_key: Optional[str] = typer.Option(None, "--eval-reward-key", help=EVAL_REWARD_KEY_HELP),
    split: Optional[str] = typer.Option(None, "--split", help=SPLIT_HELP),
    rollout_id: Optional[int] = typer.Option(None, "--id", help=ID_HELP, min=0),
    limit: int = typer.Option(20, "--limit", min=0, help="changed samples to list"),
    fail_on_change: bool = typer.Option(False, "--fail-on-change", help="exit 1 when any reward changed"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Rerun a reward function over a rollout and diff old vs new rewards."""
    from rollflow.tasks.debug.replay_reward import replay_reward  # lazy: keeps torch out of CLI start-up
    from rollflow.tasks.rollout.rewards import resolve_reward_fn

    # Console scripts do not put the working directory on sys.path; `python -m` does. Match it, so
    # `--reward my_rewards:score` finds ./my_rewards.py.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = resolve_reward_fn(reward)
    except ValueError as exc:
        _fail(f"--reward: {exc}")
    item = _select(_discover(uri), split, rollout_id)
    samples = _load_samples(item)
    reward_key = _reward_key(item.split, reward_key, eval_reward_key)
    try:
        report = replay_reward(samples, fn, reward_key)
    except ValueError as exc:
        _fail(f"--reward {reward!r}: {exc}" + ("" if reward_key else " (pass --reward-key)"))
    if as_json:
        _echo_json({"split": item.split, "rollout_id": item.rollout_id, "source": item.loader.uri, **report.to_dict()})
    else:
        from rich.table import Table
        from rich.text import Text

        console = _console()
        console.print(f"replayed {reward} over {item.split} rollout {item.rollout_id} ({item.loader.uri})")
        if report.changed:
            table = Table(title=f"changed rewards (first {min(limit, report.n_changed)} of {report.n_changed})")
            for name in ("row", "group", "index", "response", "label", "old", "new"):
                table.add_column(name)
            for pos in report.changed[:limit]:
                s = samples[pos]
                old = "-" if report.old[pos] is None else f"{report.old[pos]:.4g}"
                cells = (
                    str(pos),
                    str(s.group_index),
                    str(s.index),
                    shorten(s.response, 40),
                    shorten(s.label or "", 20),
                    old,
                    f"{report.new[pos]:.4g}",
                )
                table.add_row(*(Text(c) for c in cells))
            console.print(table)
        fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
        console.print(
            f"changed: {report.n_changed} of {report.n_samples} samples; mean reward old "
            f"{fmt(report.mean_old)} -> new {fmt(report.mean_new)}; max |diff| {fmt(report.max_abs_diff)}"
        )
    if fail_on_change and report.changed:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- send


def send_cmd(
    uri: str = typer.Argument(..., metavar="ARTIFACT_URI", help="run, artifact folder or slime template"),
    engine_name: str = typer.Option("hf", "--engine", help="rollout engine backend (hf in this build)"),
    model: str = typer.Option("builtin:addition", "--model", help="'builtin:addition' or a local HF model dir"),
    split: Optional[str] = typer.Option(None, "--split", help=SPLIT_HELP),
    rollout_id: Optional[int] = typer.Option(None, "--id", help=ID_HELP, min=0),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="send only the first N samples"),
    greedy: bool = typer.Option(False, "--greedy", help="temperature 0 (reproduces a greedy artifact exactly)"),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="when not --greedy"),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", min=1, help="default: the longest stored response"
    ),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float64"),
    device: str = typer.Option("cpu", "--device"),
    logprob_tol: float = typer.Option(1e-4, "--logprob-tol", min=0.0, help="report samples above this |diff|"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Send an artifact's prompt token ids to an engine, compare responses and log-probs."""
    from pydantic import ValidationError

    from rollflow.tasks.debug.send import send_samples  # lazy: keeps torch out of CLI start-up
    from rollflow.tasks.rollout.engine import SamplingParams
    from rollflow.tasks.rollout.settings import RolloutConfig

    item = _select(_discover(uri), split, rollout_id)
    samples = _load_samples(item)
    if limit is not None:
        samples = samples[:limit]
    if not samples:
        _fail(f"{item.loader.uri} has no samples to send")
    try:
        cfg = RolloutConfig(engine=engine_name, dtype=dtype, device=device)
    except ValidationError as exc:
        bad = "; ".join(f"--{e['loc'][0]}: {e['msg']}" for e in exc.errors())
        _fail(f"{bad} (engines: hf; dtypes: float32, bfloat16, float64)")
    longest = max(s.response_length for s in samples)
    params = SamplingParams(
        temperature=0.0 if greedy else temperature, max_new_tokens=max_new_tokens or max(1, longest), seed=seed
    )
    from rollflow.tasks.rollout.worker import build_engine  # lazy: keeps torch out of CLI start-up

    try:
        engine, _ = build_engine(model, cfg)
    except NotImplementedError as exc:
        _fail(f"--engine {engine_name!r}: {exc}")
    except (FileNotFoundError, ValueError, OSError) as exc:
        _fail(f"--model {model!r}: {exc}")
    start = time.perf_counter()
    report = send_samples(samples, engine, params, logprob_tol=logprob_tol)
    seconds = time.perf_counter() - start
    if as_json:
        _echo_json(
            {
                "split": item.split,
                "rollout_id": item.rollout_id,
                "source": item.loader.uri,
                "seconds": seconds,
                **report.to_dict(),
            }
        )
        return
    console = _console()
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    console.print(
        f"sent {report.n_samples} prompts of {item.split} rollout {item.rollout_id} to {engine_name} "
        f"({model}, {'greedy' if greedy else f'temperature {temperature}'}) in {seconds:.2f}s"
    )
    console.print(
        f"identical responses: {report.n_identical}/{report.n_samples} ({100 * (report.identical_fraction or 0):.1f}%)"
    )
    console.print(
        f"log-prob |stored - new| over {report.n_tokens_compared} common-prefix tokens: mean "
        f"{fmt(report.logprob_abs_diff_mean)}, max {fmt(report.logprob_abs_diff_max)}"
    )
    if report.first_mismatch:
        m = report.first_mismatch
        console.print(
            f"first differing sample: row {m['position']} (group {m['group_index']}, index {m['index']}), "
            f"from response token {m['first_diff_token']}: stored {m['stored_response_ids']} vs new "
            f"{m['new_response_ids']}"
        )
    if report.logprob_exceeding:
        w = report.worst_logprob
        console.print(
            f"{len(report.logprob_exceeding)} samples with log-prob |diff| > {logprob_tol:g}, rows "
            f"{report.logprob_exceeding[:20]}; worst: row {w['position']} token {w['token']}: stored "
            f"{w['stored']:.6g} vs new {w['new']:.6g}"
        )


# ----------------------------------------------------------------------------- slime import / export


def export_slime_cmd(
    uri: str = typer.Argument(..., metavar="ARTIFACT_URI", help="run or artifact folder"),
    target: str = typer.Argument(..., metavar="TEMPLATE", help="slime path template, e.g. dumps/data_{rollout_id}.pt"),
    split: Optional[str] = typer.Option(None, "--split", help=SPLIT_HELP),
    rollout_id: Optional[int] = typer.Option(None, "--id", help=ID_HELP, min=0),
    all_ids: bool = typer.Option(False, "--all", help="export every discovered rollout (of --split if given)"),
) -> None:
    """Write rollouts as slime `--save-debug-rollout-data` files (.pt, plain data)."""
    found = _discover(uri)
    if all_ids:
        if rollout_id is not None:
            _fail("--all and --id are exclusive: drop one")
        chosen = [f for f in found if split is None or f.split == split]
        if not chosen:
            _fail(f"--split {split}: nothing to export")
    else:
        chosen = [_select(found, split, rollout_id)]
    if len(chosen) > 1 and not has_rollout_id(target):
        _fail(
            f"TEMPLATE {target!r} has no {{rollout_id}} placeholder but {len(chosen)} rollouts are exported: "
            "add one, e.g. 'dumps/data_{rollout_id}.pt'"
        )
    console = _console()
    for item in chosen:
        samples = _load_samples(item)
        try:
            written = export_slime_pt(samples, item.rollout_id, target, split=item.split)
        except (ValueError, OSError) as exc:
            _fail(f"TEMPLATE {target!r}: {exc}")
        console.print(f"{item.split} rollout {item.rollout_id}: {len(samples)} samples -> {written}")


def import_slime_cmd(
    source: str = typer.Argument(..., metavar="TEMPLATE", help="slime template with {rollout_id}, or one .pt file"),
    root: str = typer.Option(..., "--root", help="artifact store root (path or fsspec URL)"),
    run: str = typer.Option(..., "--run", help="run name to import into"),
    split: Optional[str] = typer.Option(None, "--split", help=SPLIT_HELP),
    rollout_id: Optional[int] = typer.Option(None, "--id", help=ID_HELP, min=0),
    all_ids: bool = typer.Option(False, "--all", help="import every discovered file"),
    n_samples_per_prompt: Optional[int] = typer.Option(
        None, "--n-samples-per-prompt", min=1, help="default: the most common group size"
    ),
    model: str = typer.Option("unknown", "--model", help="model name recorded in the manifests"),
    vocab_size: Optional[int] = typer.Option(
        None, "--vocab-size", min=1, help="refuse token ids >= this (the vocab size of the model to train)"
    ),
) -> None:
    """Import slime debug-rollout dumps (.pt) as rollflow artifacts under ROOT/RUN.

    Content-addressed: importing the same dump again is a no-op; a different dump for an id the run
    already holds is refused (both checksums named): import it into another --run."""
    found = _discover(source)
    if all_ids:
        chosen = [f for f in found if split is None or f.split == split]
    else:
        chosen = [_select(found, split, rollout_id)]
    try:
        store = RolloutStore(root)
    except ValueError as exc:
        _fail(f"--root: {exc}")
    console = _console()
    for item in chosen:
        try:
            ref, imported = import_slime_into_store(
                store,
                run,
                item.split,
                item.rollout_id,
                item.loader.uri,
                backend="slime",
                model=model,
                n_samples_per_prompt=n_samples_per_prompt,
                vocab_size=vocab_size,
                new_run_hint="import it into a new run (--run NEW_NAME)",
            )
        except (ArtifactError, ValueError) as exc:
            _fail(f"{item.loader.uri}: {exc}")
        state = "" if imported else " (already imported, same content: nothing written)"
        console.print(f"{item.loader.uri}: -> {ref.uri}{state}")


def register(app: typer.Typer) -> None:
    """Add show, replay-reward, send, export-slime and import-slime to `app`."""
    app.command("show")(show)
    app.command("replay-reward")(replay_reward_cmd)
    app.command("send")(send_cmd)
    app.command("export-slime")(export_slime_cmd)
    app.command("import-slime")(import_slime_cmd)
