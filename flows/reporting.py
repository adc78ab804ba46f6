"""What a person sees: metrics JSONL, the reward-curve PNG, terminal lines, Prefect UI artifacts."""

from __future__ import annotations

import contextvars
import io
import json
import posixpath
import re
from typing import TYPE_CHECKING, Callable

import fsspec

from rollflow.artifacts.storage import open_fs
from rollflow.flows.config import RunConfig

if TYPE_CHECKING:  # an annotation only: the store module (pyarrow) loads where a store is built
    from rollflow.artifacts.store import RolloutStore

# Set by the caller that draws the terminal progress bar; flows call it between their tasks.
STAGE_HOOK: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("stage_hook", default=None)

HEADLINE = (
    "rollout/raw_reward",
    "eval/accuracy",
    "rollout/kl",
    "train/pg_clipfrac",
    "train/ppo_kl",
    "train/grad_norm",
    "critic/value_loss",
    "perf/iteration_s",
)  # critic/*: ppo runs only


def stage(name: str, iteration: int | None = None, line: str | None = None) -> None:
    """Tell the terminal (if anyone draws it) which step runs now; `line` is printed once done."""
    hook = STAGE_HOOK.get()
    if hook is not None:
        hook(name, iteration, line)


def run_file(cfg: RunConfig, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
    # open_fs: the standard AWS environment (AWS_ENDPOINT_URL, ...) applies to s3:// roots.
    fs, base = open_fs(cfg.store.root)
    return fs, posixpath.join(base, cfg.run, name)


def read_metrics(cfg: RunConfig) -> list[dict]:
    fs, path = run_file(cfg, "metrics.jsonl")
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line.strip()]


def write_metrics(cfg: RunConfig, rows: list[dict]) -> None:
    """Rewrite the whole file: on object stores there is no append, and rows are few."""
    fs, path = run_file(cfg, "metrics.jsonl")
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def record_iteration(cfg: RunConfig, row: dict) -> list[dict]:
    rows = [r for r in read_metrics(cfg) if r["iteration"] != row["iteration"]] + [row]
    rows.sort(key=lambda r: r["iteration"])
    write_metrics(cfg, rows)
    return rows


def truncate_metrics(cfg: RunConfig, last_iteration: int) -> None:
    """On resume, forget rows of iterations that will run again (metrics.jsonl and train_steps.jsonl)."""
    rows = read_metrics(cfg)
    kept = [r for r in rows if r["iteration"] <= last_iteration]
    if len(kept) != len(rows):
        write_metrics(cfg, kept)
    steps = read_train_steps(cfg)
    kept_steps = [r for r in steps if r["iteration"] <= last_iteration]
    if len(kept_steps) != len(steps):
        _write_jsonl(cfg, TRAIN_STEPS, kept_steps)


# Per-optimizer-step train statistics live next to metrics.jsonl (which stays one row per iteration): one row
# per optimizer step, {"iteration", "step" (global optimizer step, 1-based), "train_step/<name>": value}.
TRAIN_STEPS = "train_steps.jsonl"
STEP_PREFIX = "train_step/"


def read_train_steps(cfg: RunConfig) -> list[dict]:
    fs, path = run_file(cfg, TRAIN_STEPS)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line.strip()]


def _write_jsonl(cfg: RunConfig, name: str, rows: list[dict]) -> None:
    fs, path = run_file(cfg, name)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def step_rows(steps: list[dict[str, float]], first_step: int, **fields) -> list[dict]:
    """Rows of `train_step/*` keys numbered from `first_step`, with `fields` (e.g. iteration) on each."""
    return [
        {**fields, "step": first_step + i, **{STEP_PREFIX + k: v for k, v in stats.items()}}
        for i, stats in enumerate(steps)
    ]


def record_train_steps(cfg: RunConfig, iteration: int, steps: list[dict[str, float]]) -> list[dict]:
    """Iteration `iteration`'s optimizer steps, numbered after the last step of the iterations before it: the
    counter is monotonic across iterations and resumes (a rerun iteration replaces its own rows)."""
    kept = [r for r in read_train_steps(cfg) if r["iteration"] < iteration]
    first = max((r["step"] for r in kept), default=0) + 1
    new = step_rows(steps, first, iteration=iteration)
    _write_jsonl(cfg, TRAIN_STEPS, kept + new)
    return new


def metrics_line(row: dict) -> str:
    parts = [f"iter {row['iteration']:>3}"]
    for key in HEADLINE:
        if key in row:
            parts.append(f"{key.split('/')[-1]}={row[key]:.4g}")
    return "  ".join(parts)


def plot_rewards(cfg: RunConfig, rows: list[dict]) -> str | None:
    """Reward (and greedy eval accuracy) per iteration as a PNG next to the metrics."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    # x = the weight version that produced the numbers: rollout r is sampled with version r.
    xs = [r["rollout_id"] for r in rows]
    ax.plot(xs, [r.get("rollout/raw_reward", float("nan")) for r in rows], marker="o", label="sample reward")
    evals = [(r["rollout_id"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if "eval/final_accuracy" in rows[-1]:
        evals.append((rows[-1]["iteration"], rows[-1]["eval/final_accuracy"]))
    if evals:
        ax.plot(*zip(*evals), marker="s", label="greedy eval accuracy")
    ax.set_xlabel("policy updates (weight version)")
    ax.set_ylabel("reward")
    ax.set_title(f"rollflow run {cfg.run}")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    fs, path = run_file(cfg, "reward_curve.png")
    with fs.open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def publish_iteration(cfg: RunConfig, rows: list[dict], rollout_uri: str) -> None:
    """Metrics table (versioned by key) and a link to the rollout artifact in the Prefect UI."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    columns = ["iteration", *HEADLINE, "rollout_uri"]
    table = [{c: (round(r[c], 6) if isinstance(r.get(c), float) else r.get(c)) for c in columns} for r in rows]
    create_table_artifact(
        key=artifact_key(cfg.run, "metrics"), table=table, description=f"Per-iteration metrics of run `{cfg.run}`"
    )
    last = rows[-1]["iteration"]
    if rollout_uri.startswith(("http://", "https://")):
        create_link_artifact(
            key=artifact_key(cfg.run, "rollout"),
            link=rollout_uri,
            link_text=f"rollout artifact of iteration {last}",
            description=f"Rollout artifact of iteration {last} of run `{cfg.run}`",
        )
    else:
        # file paths and s3:// URIs are no browser links: show them as text, with the command that reads them
        create_markdown_artifact(
            key=artifact_key(cfg.run, "rollout"),
            markdown=f"Rollout artifact of iteration {last}:\n\n`{rollout_uri}`\n\n"
            f"Inspect it with `rollflow show {rollout_uri}`.",
            description=f"Rollout artifact of iteration {last} of run `{cfg.run}`",
        )


def publish_note(cfg: RunConfig, topic: str, text: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(key=artifact_key(cfg.run, topic), markdown=text, description=text[:500])


def publish_summary(
    cfg: RunConfig, store: RolloutStore, summary: dict, rows: list[dict], plot_path: str | None, note: str | None = None
) -> None:
    """The rl_train run's own artifact: final metrics, eval accuracy, where everything is, the reward curve."""
    import base64

    from prefect.artifacts import create_markdown_artifact

    lines = [f"# rollflow run `{cfg.run}`", ""]
    if note:
        lines += [f"> {note}", ""]
    lines += ["| metric | value |", "|---|---|"]
    for key, value in summary.items():
        lines.append(f"| {key} | {round(value, 6) if isinstance(value, float) else value} |")
    if rows:
        lines += ["", "## Last iteration", "", "| metric | value |", "|---|---|"]
        for key in ["iteration", *HEADLINE]:
            if key in rows[-1]:
                value = rows[-1][key]
                lines.append(f"| {key} | {round(value, 6) if isinstance(value, float) else value} |")
    lines += [
        "",
        "## Where things are",
        "",
        f"- rollout artifacts: `{store.run_uri(cfg.run)}/rollouts/`",
        f"- checkpoints: `{store.run_uri(cfg.run)}/checkpoints/`",
        f"- metrics: `{run_file(cfg, 'metrics.jsonl')[1]}`",
    ]
    if plot_path:
        fs, _ = run_file(cfg, "reward_curve.png")
        with fs.open(plot_path, "rb") as f:
            png = base64.b64encode(f.read()).decode()
        lines += [
            f"- reward curve: `{plot_path}`",
            "",
            "## Reward curve",
            "",
            f"![reward curve](data:image/png;base64,{png})",
        ]
    create_markdown_artifact(
        key=artifact_key(cfg.run, "summary"),
        markdown="\n".join(lines),
        description=f"Summary of rollflow run `{cfg.run}`",
    )
