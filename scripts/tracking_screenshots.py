"""Screenshots of a demo run in TensorBoard and in the MLflow UI (docs/ui/tensorboard.png, docs/ui/mlflow.png).

    .venv/bin/python scripts/tracking_screenshots.py [--out docs/ui] [--iterations 8]   # needs chromium

Starts a throwaway Prefect server, runs `rollflow demo` with `tracking.backends=["tensorboard","mlflow"]` into a
temporary store, then serves the run with `tensorboard --logdir` and `mlflow server` on loopback ports and
photographs them with headless chromium. Stops exactly the processes it started, by pid (process group).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ui_screenshots import BIN, ROOT, free_port, shoot, stop, wait_http  # noqa: E402

RUN = "demo-tracked"


def start(cmd: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """A server in its own process group (so stopping it stops its workers too), output to `log`."""
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )


def shoot_after(
    url: str,
    out: Path,
    chromium: str,
    steps: list[str],
    *,
    width: int = 1440,
    height: int = 1000,
    load_s: float = 15.0,
    step_s: float = 7.0,
) -> None:
    """A screenshot after real time and a few JavaScript steps (clicks, typing), through the DevTools protocol:
    the MLflow UI loads its charts lazily and asynchronously, which `--screenshot` with a virtual-time budget
    photographs as spinners."""
    from websockets.sync.client import connect

    port = free_port()
    profile = tempfile.mkdtemp(prefix="rollflow-chromium-")
    proc = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--remote-debugging-address=127.0.0.1",
            f"--remote-debugging-port={port}",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/json/version", timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:  # noqa: S310
            page = next(t for t in json.load(resp) if t["type"] == "page")
        ids = itertools.count(1)
        with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:

            def call(method: str, **params) -> dict:
                msg_id = next(ids)
                ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv())
                    if msg.get("id") == msg_id:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})

            call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            call("Page.navigate", url=url)
            time.sleep(load_s)
            for step in steps:
                call("Runtime.evaluate", expression=step, awaitPromise=True)
                time.sleep(step_s)
            out.write_bytes(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
        print(f"{out}  <- {url}")
    finally:
        stop([proc])
        shutil.rmtree(profile, ignore_errors=True)


def click(text: str) -> str:
    """JavaScript: click the first element whose aria-label or own text is `text` (no-op if none)."""
    return (
        f"(() => {{ const el = [...document.querySelectorAll('button, [role=radio], label, span, div')].find("
        f"e => e.getAttribute('aria-label') === {json.dumps(text)} || (e.children.length === 0 && e.innerText === "
        f"{json.dumps(text)}));"
        f" if (el) el.click(); return !!el; }})()"
    )


def type_into(placeholder: str, text: str) -> str:
    """JavaScript: type `text` into the input whose placeholder contains `placeholder` (React sees the event)."""
    selector = json.dumps(f"input[placeholder*={json.dumps(placeholder)}]")
    return (
        f"(() => {{ const i = document.querySelector({selector}); if (!i) return false;"
        " Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(i, "
        f"{json.dumps(text)}); i.dispatchEvent(new Event('input', {{bubbles: true}})); return true; }})()"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "ui"))
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs)")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        sys.exit("chromium not found: apt install chromium (or set PATH)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollflow-tracking-ui-"))
    runs = work / "runs"
    prefect_port, tb_port, mlflow_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_ENABLE_TELEMETRY": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    env.pop("PREFECT_API_URL", None)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            start(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                env,
                work,
                work / "prefect.log",
            )
        )
        wait_http(api + "/health")
        env["PREFECT_API_URL"] = api
        subprocess.run(
            [
                str(BIN / "rollflow"),
                "demo",
                "--iterations",
                str(args.iterations),
                "--run",
                RUN,
                "--root",
                str(runs),
                "--set",
                'tracking.backends=["tensorboard","mlflow"]',
            ],
            env=env,
            cwd=work,
            check=True,
        )
        state = json.loads((runs / RUN / "tracking.json").read_text())

        procs.append(
            start(
                [
                    str(BIN / "tensorboard"),
                    "--logdir",
                    str(runs / RUN / "tensorboard"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(tb_port),
                ],
                env,
                work,
                work / "tensorboard.log",
            )
        )
        # the default tracking.uri of a local store: {store.root}/mlruns (SQLite store + artifacts beside it)
        procs.append(
            start(
                [
                    str(BIN / "mlflow"),
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{runs / 'mlruns' / 'mlflow.db'}",
                    "--default-artifact-root",
                    (runs / "mlruns" / "artifacts").as_uri(),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                    "--workers",
                    "1",
                ],
                env,
                work,
                work / "mlflow.log",
            )
        )
        tb, ml = f"http://127.0.0.1:{tb_port}", f"http://127.0.0.1:{mlflow_port}"
        wait_http(tb)
        wait_http(ml + "/health")

        from mlflow.tracking import MlflowClient

        run = MlflowClient(tracking_uri=ml).get_run(state["mlflow_run_id"])
        exp = run.info.experiment_id
        # TensorBoard's scalars dashboard, the rollout/ and train/ charts (step = iteration), train_step/ below
        shoot(
            f"{tb}/?darkMode=false#scalars&tagFilter=rollout%2Fraw_reward%7Ceval%2Faccuracy%7Ctrain%2Floss%7C"
            "train_step%2Floss%7Ctrain_step%2Fgrad_norm%7Ctrain%2Fppo_kl",
            out / "tensorboard.png",
            chromium,
            height=1100,
        )
        page = f"{ml}/#/experiments/{exp}/runs/{run.info.run_id}/model-metrics"
        # MLflow 3 opens in its GenAI view with an assistant panel: close it, switch to Model training, come
        # back to the run's charts and keep the headline ones (the search box takes a regex)
        shoot_after(
            page,
            out / "mlflow.png",
            chromium,
            [
                click("Close"),
                click("Model training"),
                f"location.hash = {page.split('#', 1)[1]!r}",
                type_into("Search metric", "raw_reward|^eval/accuracy|^train/loss|^train_step/(loss|grad_norm)"),
            ],
            height=2000,
        )
    finally:
        stop(procs)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
