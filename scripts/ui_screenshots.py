"""Screenshots of what a Prefect user sees of rollflow (docs/ui/*.png), made from real runs on this machine.

    .venv/bin/python scripts/ui_screenshots.py [--out docs/ui]      # needs chromium (apt install chromium)

Starts a throwaway Prefect server and `rollflow worker`, runs from the deployments: rollout_only, a
replay_train pinned to its ids, and an rl_train that fails on purpose (debug.fail_after_iteration) and is
retried the way the UI's Retry button does; then photographs the deployments page, the replay form, the
resumed run and the rl_train summary artifact with its reward curve. Stops what it started, by pid.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = {"data": {"prompts_per_rollout": 8}, "rollout": {"n_samples_per_prompt": 2, "threads": 1}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - loopback
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer")


def wait_final(client, flow_run_id, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(1)
    raise RuntimeError(f"flow run {flow_run_id} did not finish")


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the processes this script started (by process group, newest first): SIGINT, then SIGKILL."""
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def shoot(url: str, out: Path, chromium: str, height: int = 1000) -> None:
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size=1440,{height}",
            "--virtual-time-budget=20000",
            f"--screenshot={out}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"{out}  <- {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "ui"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        sys.exit("chromium not found: apt install chromium (or set PATH)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollflow-ui-"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    ui = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "RAY_AUTH_MODE": "disabled",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "PREFECT_UI_API_URL": api,
    }  # the browser app asks this address (default: port 4200)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        wait_http(api + "/health")
        env["PREFECT_API_URL"] = api
        os.environ.update({k: env[k] for k in ("PREFECT_API_URL", "PREFECT_HOME")})
        procs.append(
            subprocess.Popen(
                [str(BIN / "rollflow"), "worker"],
                cwd=work,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        from prefect.client.orchestration import get_client
        from prefect.states import AwaitingRetry

        root = str(work / "runs")
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 120
            while len(client.read_deployments()) < 6:
                if time.monotonic() > deadline:
                    raise RuntimeError("rollflow worker did not register its deployments")
                time.sleep(1)
            deps = {(client.read_flow(d.flow_id).name, d.name): d for d in client.read_deployments()}

            def run(flow: str, params: dict):
                created = client.create_flow_run_from_deployment(deps[(flow, "worker")].id, parameters=params)
                return wait_final(client, created.id)

            run("rollout_only", {"params": {"run": "exp1-rollouts", "iterations": 2, "store": {"root": root}, **SMALL}})
            run(
                "replay_train",
                {
                    "params": {"run": "exp1-replay", "store": {"root": root}},
                    "rollout_ids": [0, 1],
                    "source_run": "exp1-rollouts",
                },
            )
            # the demo's recipe (256 prompts x 8 samples), so the curve shows learning
            failed = run(
                "rl_train",
                {
                    "params": {
                        "run": "exp1",
                        "iterations": 8,
                        "eval_every": 4,
                        "store": {"root": root},
                        "debug": {"fail_after_iteration": 4},
                    }
                },
            )
            client.set_flow_run_state(failed.id, AwaitingRetry(message="Retry from the UI"), force=True)
            resumed = wait_final(client, failed.id)
            print(f"rl_train {resumed.name}: {resumed.state.name}, run_count {resumed.run_count}")
            summary = client.read_latest_artifacts()  # newest version of every key
            summary_id = next(a.latest_id for a in summary if a.key == "exp1-summary")

        shoot(f"{ui}/deployments", out / "deployments.png", chromium)
        shoot(
            f"{ui}/deployments/deployment/{deps[('replay_train', 'worker')].id}/run",
            out / "replay-form.png",
            chromium,
            height=1400,
        )
        shoot(f"{ui}/runs/flow-run/{resumed.id}", out / "resumed-rl-train.png", chromium)
        shoot(f"{ui}/artifacts/artifact/{summary_id}", out / "rl-train-summary.png", chromium, height=1600)
    finally:
        stop(procs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
