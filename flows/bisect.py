"""`ima_bisect`: illegal-memory-access triage as a flow (issue 8; docs/architecture.md section 9, "IMA checklist").

1. every cell of the toggle matrix (cuda_graph x speculative x deepep) runs the reproducer, a rollout-only
   generation on pinned prompts, as one task; the reproducer runs in its own process with a timeout, so a
   crash or a hang is a row of the table, never the end of the flow; toggles the engine lacks are n/a rows;
2. the first crashing cell runs again with `CUDA_LAUNCH_BLOCKING=1` (the error then names the faulting
   kernel's launch), then with the CUDA core-dump variables set (the dump is read with cuda-gdb);
3. a table artifact (one row per cell), a markdown verdict, a link per core dump; core dumps, logs and a
   JSON report under `{store.root}/{run}/coredumps/` (logs under `{run}/ima_logs/`).

The plain steps live in `tasks/debug/ima.py` (the GPU box runs them without Prefect:
`python -m rollflow.tasks.debug.ima --matrix`).
"""

from __future__ import annotations

import json
import posixpath
import shutil
import tempfile
from pathlib import Path

import fsspec
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.flows import reporting, tracking
from rollflow.flows.config import RunConfig
from rollflow.flows.params import BisectParams
from rollflow.flows.prefect_ops.heartbeats import with_heartbeats
from rollflow.flows.prefect_ops.naming import flow_run_name, tag_current_run
from rollflow.tasks.debug.ima import (
    COREDUMP,
    ERROR,
    LAUNCH_BLOCKING,
    MATRIX,
    REPRO_SECTIONS,
    BisectReport,
    Cell,
    CellPlan,
    CellResult,
    backend_toggles,
    format_toggles,
    host_context,
    inspect_coredump,
    na_result,
    parse_toggles,
    pick_rerun_cell,
    run_cell,
    toggle_matrix,
    toggle_support_table,
    verdict,
)

REPORT_NAME = "ima_report.json"


@task(name="ima-cell", cache_policy=NO_CACHE, task_run_name="ima-{pass_name}-{cell_key}")
def ima_cell_task(
    config_json: str,
    toggles: dict,
    cell_key: str,
    *,
    backend: str,
    pass_name: str,
    run_dir: str,
    crash_when: str | None,
    fault: str | None,
    timeout_s: float,
    rollout_ids: list[int],
) -> dict:
    """One reproducer run in its own process; returns the cell's row (a crash is a result, not a failure)."""
    result = run_cell(
        config_json,
        Cell.from_toggles(toggles),
        backend=backend,
        pass_name=pass_name,
        run_dir=run_dir,
        crash_when=crash_when,
        fault=fault,
        timeout_s=timeout_s,
        rollout_ids=rollout_ids,
    )
    return result.to_dict()


@task(name="ima-inspect-coredump", cache_policy=NO_CACHE)
def inspect_coredump_task(path: str) -> dict:
    return inspect_coredump(path)


def _store_location(cfg: RunConfig) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    """(filesystem, run folder in it, whether it is the local disk)."""
    fs, base = fsspec.core.url_to_fs(cfg.store.root)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return fs, posixpath.join(base, cfg.run), bool({"file", "local"} & set(protocols))


def _collect(future, plan: CellPlan, pass_name: str) -> CellResult:
    out = future.result(raise_on_failure=False)
    if isinstance(out, dict):
        return CellResult.from_dict(out)
    return CellResult(
        toggles=plan.cell.toggles(),
        pass_name=pass_name,
        outcome=ERROR,
        note=f"the cell runner failed: {type(out).__name__}: {out}",
        plan=plan.describe(),
    )


def _upload(fs, local_dir: Path, run_path: str) -> dict[str, str]:
    """Copy core dumps, logs and reports from a local scratch folder to the store; local path -> store URI."""
    moved: dict[str, str] = {}
    for sub in ("coredumps", "ima_logs"):
        for path in sorted((local_dir / sub).glob("*")):
            if path.is_file():
                target = posixpath.join(run_path, sub, path.name)
                fs.makedirs(posixpath.dirname(target), exist_ok=True)
                fs.put_file(str(path), target)
                moved[str(path)] = fs.unstrip_protocol(target)
    return moved


def _uri(fs, path: str, local: bool) -> str:
    return Path(path).resolve().as_uri() if local else fs.unstrip_protocol(path)


@flow(name="ima_bisect", flow_run_name=flow_run_name("/bisect"))
@with_heartbeats
def ima_bisect(
    params: BisectParams,
    crash_when: str | None = None,  # type: ignore[valid-type]
    timeout_s: float = 300,
    coredump: bool = True,
    fault: str | None = None,
    parallel: int = 1,
    rollout_id: int = 0,
) -> dict:
    """Illegal-memory-access triage: toggle matrix, launch-blocking rerun, core-dump rerun, one table.

    `params`: the RunConfig sections it reads, or a whole RunConfig (flows/params.py).
    `crash_when` (debug switch, e.g. 'cuda_graph=on,speculative=on') arms a fault in the reproducer's decode
    step in matching cells only (`fault`: abort | raise on CPU, triton_oob | device_assert on CUDA; default
    by device). `parallel` cells run at once (mind GPU memory with a real model).
    """
    cfg = params.run_config()
    tag_current_run(cfg.run, "bisect")
    log = get_run_logger()
    if crash_when is not None:
        crash_when = format_toggles(parse_toggles(crash_when))  # a typo fails here, before anything runs
    backend = cfg.rollout.engine
    mapping = backend_toggles(backend)
    fs, run_path, local = _store_location(cfg)
    scratch = Path(run_path) if local else Path(tempfile.mkdtemp(prefix=f"rollflow-ima-{cfg.run}-"))
    scratch.mkdir(parents=True, exist_ok=True)
    config_json = json.dumps({key: getattr(cfg, key).model_dump(mode="json") for key in REPRO_SECTIONS})
    common = dict(
        backend=backend,
        run_dir=str(scratch),
        crash_when=crash_when,
        fault=fault,
        timeout_s=float(timeout_s),
        rollout_ids=[rollout_id],
    )

    def submit(plan: CellPlan, pass_name: str):
        return ima_cell_task.submit(config_json, plan.cell.toggles(), plan.cell.key, pass_name=pass_name, **common)

    plans = toggle_matrix()
    plans = [mapping.plan(c) for c in plans]
    results: dict[int, CellResult] = {}
    for i, plan in enumerate(plans):
        if not plan.applicable:
            results[i] = na_result(plan)
            log.info(f"{plan.cell.label}: n/a ({plan.reason})")
    runnable = [i for i, p in enumerate(plans) if p.applicable]
    width = max(1, int(parallel))
    for start in range(0, len(runnable), width):
        wave = [(i, submit(plans[i], MATRIX)) for i in runnable[start : start + width]]
        for i, future in wave:
            results[i] = _collect(future, plans[i], MATRIX)
            r = results[i]
            log.info(f"{r.cell.label}: {r.outcome}" + (f" ({r.first_error})" if r.first_error else ""))
    cells = [results[i] for i in range(len(plans))]
    report = BisectReport(
        backend,
        crash_when,
        fault,
        cells,
        verdict([(r.toggles, r.outcome) for r in cells]),
        support=toggle_support_table(backend),
        context={
            **host_context(),
            "run": cfg.run,
            "store": cfg.store.root,
            "config_hash": cfg.config_hash(),
            "rollout_id": rollout_id,
            "timeout_s": float(timeout_s),
        },
    )
    log.info(f"verdict: {report.verdict.text}")

    target = pick_rerun_cell(cells)
    if target is not None:
        plan = mapping.plan(target.cell)
        lb = _collect(submit(plan, LAUNCH_BLOCKING), plan, LAUNCH_BLOCKING)
        report.reruns.append(lb)
        log.info(
            f"launch-blocking rerun of {plan.cell.label}: {lb.outcome}; kernel {lb.kernel or '?'}; "
            f"first error {lb.first_error}"
        )
        if coredump:
            cd = _collect(submit(plan, COREDUMP), plan, COREDUMP)
            report.reruns.append(cd)
            report.coredump_inspections = [inspect_coredump_task(p) for p in cd.coredumps]
            log.info(f"core-dump rerun of {plan.cell.label}: {cd.outcome}; {len(cd.coredumps)} core dump(s)")
    return _publish(cfg, report, fs, run_path, scratch, local)


def _publish(cfg: RunConfig, report: BisectReport, fs, run_path: str, scratch: Path, local: bool) -> dict:
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    if not local:
        moved = _upload(fs, scratch, run_path)
        for r in [*report.cells, *report.reruns]:
            r.coredumps = [moved.get(p, p) for p in r.coredumps]
            r.log_path = moved.get(r.log_path, r.log_path) if r.log_path else None
        for info in report.coredump_inspections:
            info["path"] = moved.get(info["path"], info["path"])
        shutil.rmtree(scratch, ignore_errors=True)  # our own temporary folder; everything is in the store now
    report_path = posixpath.join(run_path, "coredumps", REPORT_NAME)
    markdown_path = posixpath.join(run_path, "coredumps", "ima_report.md")
    fs.makedirs(posixpath.dirname(report_path), exist_ok=True)
    title = f"IMA bisect of run `{cfg.run}`"
    markdown = report.to_markdown(title=title)
    with fs.open(report_path, "w") as f:
        f.write(json.dumps(report.to_dict(), indent=1, default=str))
    with fs.open(markdown_path, "w") as f:
        f.write(markdown)
    report_uri = _uri(fs, report_path, local)

    create_table_artifact(
        key=reporting.artifact_key(cfg.run, "ima-matrix"),
        table=report.rows(),
        description=f"IMA toggle matrix of run `{cfg.run}`: {report.verdict.text}",
    )
    create_markdown_artifact(
        key=reporting.artifact_key(cfg.run, "ima-verdict"),
        markdown=markdown + f"\nJSON report: `{report_uri}`\n",
        description=f"IMA bisect verdict of run `{cfg.run}`",
    )
    create_link_artifact(
        key=reporting.artifact_key(cfg.run, "ima-report"),
        link=report_uri,
        link_text="IMA bisect JSON report",
        description=f"IMA bisect report of run `{cfg.run}`",
    )
    links = []
    for i, path in enumerate(report.coredumps):
        uri = path if "://" in path else _uri(fs, path, True)
        links.append(uri)
        create_link_artifact(
            key=reporting.artifact_key(cfg.run, "coredump", str(i)),
            link=uri,
            link_text=Path(path).name,
            description=f'GPU core dump of run `{cfg.run}`: cuda-gdb -ex "target cudacore {path}"',
        )
    out = report.to_dict()
    out.update(
        {
            "json_path": report_path if local else report_uri,
            "report_uri": report_uri,
            "coredump_links": links,
            "rows": report.rows(),
        }
    )
    with tracking.start(cfg, "ima_bisect", suffix="-ima-bisect", links={"rollflow.ima_report": report_uri}) as tracker:
        tracker.log_text("ima_verdict", markdown)  # the verdict table
        tracker.set_summary({"ima.verdict": report.verdict.text})
    return out
