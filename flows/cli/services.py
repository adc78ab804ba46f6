"""`rollflow worker`, `rollflow automations`, `rollflow server start|stop`: the Prefect side a team keeps running.

The root app calls `register(app)`; shared helpers come from flows/cli/common.py (no import circle).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from rollflow.flows.cli.common import (
    ConfigOpt,
    SetOpt,
    build_config,
    console,
    ensure_prefect_api,
    fail,
    plain_console,
    user_errors,
)
from rollflow.infra import local_stack
from rollflow.infra.automations import apply_with_alert, ensure_crash_detection, ensure_deployment_alert


def register(app: typer.Typer) -> None:
    server_app = typer.Typer(no_args_is_help=True, help="The local Prefect server (and S3 endpoint) on loopback.")
    app.add_typer(server_app, name="server")

    @app.command()
    def worker(
        nightly_cron: str = typer.Option("0 2 * * *", help="cron (UTC) of the nightly alignment check; '' for none"),
        config: Optional[str] = ConfigOpt,
        sets: Optional[List[str]] = SetOpt,
    ) -> None:
        """Serve every flow as a deployment (`<flow>/worker`) plus the nightly alignment check, from this process.

        Runs created in the UI, by `--submit` or by the schedule execute here; keep it alive as a service
        (infra/rollflow-worker.service). --config/--set give the nightly check's parameters."""
        with user_errors("worker"):
            cfg = build_config(config, [*(sets or [])], {"run": "nightly"})
            api = ensure_prefect_api()
            from prefect import serve

            # lazy: keeps torch/prefect out of CLI start-up
            from rollflow.flows.prefect_ops.deployments import served_deployments

            deployments = served_deployments(nightly_cron or None, cfg)
            for dep in deployments:
                if "nightly" in (dep.tags or []):
                    apply_with_alert(dep)  # the alert on Failed/Crashed/Late nightly runs exists before any run
            names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
            plain_console().print(f"serving {names}; UI: {api.removesuffix('/api')}/deployments")
            serve(*deployments, print_starting_message=False)

    @app.command()
    def automations(
        alert_on: Optional[List[str]] = typer.Option(
            None,
            "--alert-on",
            help="deployment to alert on (Failed/Crashed/Late runs), repeatable; default "
            "alignment_check/nightly-alignment-pool (infra/prefect.yaml's nightly)",
        ),
    ) -> None:
        """Create (idempotently) the crash-detection automation and the alerts of deployments registered with
        `prefect deploy` (`rollflow worker` and `rollflow serve` do this themselves)."""
        with user_errors("automations"):
            ensure_prefect_api()
            from prefect.client.orchestration import get_client
            from prefect.exceptions import ObjectNotFound

            console.print(f"crash detection: automation {ensure_crash_detection()}")
            for name in alert_on or ["alignment_check/nightly-alignment-pool"]:
                with get_client(sync_client=True) as client:
                    try:
                        dep = client.read_deployment_by_name(name)
                    except ObjectNotFound:
                        fail(
                            f"deployment {name!r} is not registered: run `prefect deploy --prefect-file "
                            "infra/prefect.yaml --all` first, or name another with --alert-on FLOW/DEPLOYMENT"
                        )
                console.print(f"alert on {name}: automation {ensure_deployment_alert(dep.id, name)}")

    @server_app.command("start")
    def server_start(port: int = typer.Option(4200)) -> None:
        """Start (or reuse) the local Prefect server; prints the API URL to export."""
        api = local_stack.start_prefect(port)
        console.print(f"export PREFECT_API_URL={api}   # UI: {api.removesuffix('/api')}")

    @server_app.command("stop")
    def server_stop() -> None:
        console.print("stopped" if local_stack.stop("prefect") else "no server started by rollflow is running")
