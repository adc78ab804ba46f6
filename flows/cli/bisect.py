"""`rollflow bisect`: illegal-memory-access triage (the `ima_bisect` flow, or the plain runner with --local).

The root app (flows/cli/root.py) calls `register(app)`; shared helpers come from flows/cli/common.py (no import circle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from rollflow.flows.cli.common import (
    ConfigOpt,
    SetOpt,
    build_config,
    console,
    ensure_prefect_api,
    err_console,
    fail,
    notice,
    quiet_prefect_console,
    user_errors,
)
from rollflow.tasks.debug.ima import parse_toggles, run_matrix


def run_local(
    cfg, *, crash_when: Optional[str], timeout_s: float, coredump: bool, fault: Optional[str], parallel: int, log=print
) -> dict:
    """The same triage in this process, no Prefect server: the store root must be a local folder."""
    from rollflow.flows.bisect import REPORT_NAME, _store_location  # lazy: keeps torch/prefect out of CLI start-up

    fs, run_path, local = _store_location(cfg)
    if not local:
        raise ValueError(
            f"--local writes core dumps next to the run: store.root={cfg.store.root!r} must be a local "
            "folder (or drop --local to run the flow, which uploads them)"
        )
    report = run_matrix(
        json.loads(cfg.model_dump_json()),
        backend=cfg.rollout.engine,
        run_dir=run_path,
        crash_when=crash_when,
        fault=fault,
        timeout_s=timeout_s,
        coredump=coredump,
        parallel=parallel,
        log=log,
    )
    report.context.update({"run": cfg.run, "store": cfg.store.root, "config_hash": cfg.config_hash()})
    out_dir = Path(run_path) / "coredumps"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / REPORT_NAME).write_text(json.dumps(report.to_dict(), indent=1, default=str))
    markdown = report.to_markdown(title=f"IMA bisect of run `{cfg.run}`")
    (out_dir / "ima_report.md").write_text(markdown)
    return report.to_dict() | {"json_path": str(out_dir / REPORT_NAME), "markdown": markdown}


def register(app: typer.Typer) -> None:
    @app.command("bisect")
    def bisect(
        config: Optional[str] = ConfigOpt,
        sets: Optional[List[str]] = SetOpt,
        crash_when: Optional[str] = typer.Option(
            None,
            "--crash-when",
            help="debug switch: fault the decode step in cells matching e.g. 'cuda_graph=on,speculative=on'",
        ),
        timeout_s: float = typer.Option(300.0, "--timeout-s", help="per-cell limit; a hang is killed"),
        fault: Optional[str] = typer.Option(
            None, "--fault", help="with --crash-when: abort | raise (CPU), triton_oob | device_assert (CUDA)"
        ),
        parallel: int = typer.Option(1, "--parallel", min=1, help="matrix cells run at once"),
        no_coredump: bool = typer.Option(False, "--no-coredump", help="skip the core-dump rerun"),
        local: bool = typer.Option(False, "--local", help="run in this process: no Prefect server"),
        as_json: bool = typer.Option(False, "--json", help="print the JSON report instead of markdown"),
    ) -> None:
        """Illegal-memory-access triage: CUDA graph x speculative x DeepEP matrix, each cell in its own process;
        a launch-blocking rerun and a CUDA core-dump rerun of a crashing cell; one table and a verdict."""
        cfg = build_config(config, sets)
        try:
            if crash_when is not None:
                parse_toggles(crash_when)
        except ValueError as exc:
            fail(f"--crash-when {crash_when!r}: {exc}")
        for text in cfg.notices:
            notice(text)
        kwargs = dict(
            crash_when=crash_when, timeout_s=timeout_s, coredump=not no_coredump, fault=fault, parallel=parallel
        )
        with user_errors("bisect"):
            out, markdown = _bisect(cfg, local, kwargs)
        if as_json:
            typer.echo(json.dumps(out, indent=2, default=str))
        else:
            if markdown:
                typer.echo(markdown)
            else:
                console.print(f"verdict: {out['verdict']['text']}")
            typer.echo(f"JSON report: {out['json_path']}")


def _bisect(cfg, local: bool, kwargs: dict) -> tuple[dict, Optional[str]]:
    from rollflow.flows.preflight import preflight  # lazy: keeps torch/prefect out of CLI start-up

    preflight(cfg, "bisect")  # before Prefect, Ray or any worker process: one line, exit 2
    if local:
        out = run_local(cfg, log=lambda m: err_console.print(m, markup=False, highlight=False), **kwargs)
        return out, out.pop("markdown")
    quiet_prefect_console()
    api = ensure_prefect_api()
    err_console.print(
        f"IMA bisect of run [bold]{cfg.run}[/] ({cfg.rollout.engine} engine); Prefect UI at {api.removesuffix('/api')}"
    )
    from rollflow.flows.bisect import ima_bisect  # lazy: keeps torch/prefect out of CLI start-up

    out = ima_bisect(cfg, **kwargs)
    markdown = Path(out["json_path"]).with_name("ima_report.md").read_text() if "://" not in out["json_path"] else None
    return out, markdown
