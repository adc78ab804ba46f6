"""Experiment tracking: the rows of metrics.jsonl to TensorBoard, MLflow and Weights & Biases (issue 21).

One schema for every sink: the numeric keys of a metrics.jsonl row (rollout/*, train/*, eval/*, perf/*,
mismatch/*, sync/*), step = iteration (rl_train), rollout id (rollout_only, replay_train) or the night's
number (alignment_check). Per-optimizer-step train statistics go as `train_step/*` (loss, pg_loss, grad_norm,
...) at step = the global optimizer step (rl_train: train_steps.jsonl's `step`, monotonic across iterations and
resumes; replay_train: counted over the replayed rollouts). The config is logged once per tracking run
(flattened RunConfig; URLs in it carry no credentials, RunConfig refuses them, and keys that look like secrets
are dropped anyway).

Semantics that hold for every sink:
- rl_train logs an iteration once its checkpoint is committed (`logged_through` in
  `{store.root}/{run}/tracking.json`), so a resume never logs a step twice: MLflow cannot delete a metric
  point, and W&B refuses steps that go back. The same file keeps the MLflow and W&B run ids, so a resume
  (or a Prefect retry) continues the same tracking run. A kill between a sink taking a row and that file
  recording it makes the resume log the row again: MLflow and TensorBoard skip the (key, step) points their
  run already holds; W&B cannot be asked (offline runs keep no history to read back) and may chart such a
  row twice. A resume from an older checkpoint than the last logged step starts new tracking runs, and a new
  TensorBoard folder (`rl_train/resumed-<checkpoint>-<time>`), so redone steps never sit beside the old ones.
- Logging never fails training: a sink that raises is reported once (a warning) and disabled for the rest
  of the run, unless `tracking.fatal`. A backend that is not installed is one line naming the extra.
- A sink whose setup cannot work (an unreachable MLflow server, a store MLflow refuses) is found when the
  tracker starts, which every flow does before its workers start: one line, then as above.

Backends are imported lazily (none of them at `import rollflow...`). TensorBoard event files are written with
the `tensorboard` package's own writer (no torch, no TensorFlow).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import unquote, urlsplit

from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import RolloutStore
from rollflow.flows import reporting
from rollflow.flows.config import RunConfig
from rollflow.flows.reporting import STEP_PREFIX

EXTRA = "pip install 'rollflow[tracking]'"
STATE_FILE = "tracking.json"
TB_FOLDER = "tensorboard_folder"  # tracking.json key: a kept tracking run's TensorBoard folder, if not the flow's
STEP_KEYS = frozenset({"iteration"})  # the step itself, not a metric
# STEP_PREFIX: per-optimizer-step train statistics (train_step/*; reporting.py: train_steps.jsonl)
ROW_AXIS, STEP_AXIS = "step", "train_step/step"  # W&B x-axis metrics of rows and of optimizer steps
SECRET_KEY = re.compile(r"key|secret|token|password|credential", re.I)
_log = logging.getLogger("rollflow.tracking")


class TrackingError(RuntimeError):
    """A tracking backend failed (or is missing) and `tracking.fatal` is set."""


class TrackingUnusable(RuntimeError):
    """A sink's configuration cannot work (server unreachable, store refused); found before it is opened."""


def report_problem(message: str) -> None:
    """One warning, in the flow run's log when there is one (tests patch this to count them)."""
    try:
        from prefect import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # noqa: BLE001 - outside a flow or task run
        _log.warning(message)


def numeric_metrics(row: dict) -> dict[str, float]:
    """The metrics of a row: its numeric values (bools as 0/1), without the step key and without text."""
    out = {}
    for key, value in row.items():
        if key in STEP_KEYS or isinstance(value, str) or value is None:
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
    return out


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists as JSON; secret-looking keys dropped."""
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            if SECRET_KEY.search(str(key)):
                continue
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    out[key] = json.dumps(data) if isinstance(data, (list, tuple)) else data
    return out


def config_params(cfg: RunConfig) -> dict[str, Any]:
    return flatten(cfg.model_dump(mode="json"))


# ---- where things go ------------------------------------------------------------------------------------


def local_store_root(cfg: RunConfig) -> str | None:
    fs, base = open_fs(cfg.store.root)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return base if {"file", "local"} & set(protocols) else None


def tracking_dir(cfg: RunConfig) -> Path:
    """Local folder of TensorBoard event files and W&B run files."""
    if cfg.tracking.dir:
        return Path(cfg.tracking.dir).expanduser() / cfg.run
    root = local_store_root(cfg)
    return Path(root) / cfg.run if root else Path("rollflow-tracking") / cfg.run


def mlflow_uri(cfg: RunConfig) -> str:
    """The MLflow tracking URI. A local folder (the default: `{store.root}/mlruns`), given as a path or a
    `file://` URI, holds a SQLite store, `mlflow.db`, and the artifacts (MLflow 3 refuses its old file
    store); other URLs are used as given."""
    uri = cfg.tracking.uri
    if uri is None:
        root = local_store_root(cfg)
        uri = str(Path(root) / "mlruns") if root else "mlruns"
    parts = urlsplit(uri)
    if parts.scheme == "file" and parts.netloc in ("", "localhost"):
        uri = unquote(parts.path)  # MLflow's usual local form names the same folder
    elif ":" in uri.split("/", 1)[0]:  # a scheme: http(s)://, sqlite:///, databricks
        return uri
    path = Path(uri).expanduser().resolve()
    if path.suffix != ".db":
        path = path / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def mlflow_artifact_location(uri: str) -> str | None:
    """Artifacts of a local SQLite store next to its database (not in the current directory)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "artifacts").as_uri()
    return None


PROBE_TIMEOUT_S = 5.0


def mlflow_problem(uri: str) -> str | None:
    """Why MLflow cannot work at `uri`, found in seconds (None when it can). A server is only asked whether it
    takes connections: MLflow's own client retries an unreachable one for minutes. Any other store is opened
    and searched once, as the sink would (creating a SQLite store's database)."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname or "", port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            where = f"{parts.scheme}://{parts.hostname}:{port}"
            return f"MLflow tracking server {where} is unreachable ({exc.strerror or exc})"
        return None
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        return None  # the sink's start names the missing extra
    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any refusal: the store cannot be used
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"MLflow refuses the tracking store {uri} ({type(exc).__name__}: {first})"
    return None


def mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, _ - . space / : in names: `eval/pass@4` becomes `eval/pass_at_4`."""
    return re.sub(r"[^\w\-. /:]", "_", key.replace("@", "_at_"))


# ---- sinks ------------------------------------------------------------------------------------------------


class Sink:
    name = "sink"

    def problem(self) -> str | None:
        """Why this sink cannot work, found cheaply before any worker starts (None: try it)."""
        return None

    def open(self, state: dict, params: dict[str, Any] | None, tags: dict[str, str]) -> None: ...
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def log_text(self, key: str, text: str, step: int = 0) -> None: ...
    def log_file(self, path: str, folder: str | None = None) -> None: ...
    def set_summary(self, values: dict[str, Any]) -> None: ...
    def close(self, ok: bool) -> None: ...


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.writer = None
        self.logged: set[tuple[str, int]] = set()  # (tag, step) scalar points the folder already holds

    def open(self, state, params, tags):
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise ImportError(f"tracking backend 'tensorboard' is not installed: {EXTRA}") from exc
        self.logdir.mkdir(parents=True, exist_ok=True)
        # A kill can land after the event file took a committed row and before tracking.json recorded it: the
        # resume logs that row again, and TensorBoard would chart both points (it drops neither).
        self.logged = tensorboard_points(self.logdir)
        self.writer = EventFileWriter(str(self.logdir))
        if params is not None:
            lines = ["| key | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(params.items()))]
            self.log_text("config", "\n".join(lines))
        if tags:
            self.log_text("links", "\n".join(f"- {k}: {v}" for k, v in tags.items()))

    def _write(self, values: list, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self.writer.flush()

    def log(self, metrics, step):
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items() if (k, step) not in self.logged]
        if values:
            self._write(values, step)

    def log_text(self, key, text, step=0):
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(
            dtype=DT_STRING,
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        self._write([Summary.Value(tag=key, metadata=meta, tensor=tensor)], step)

    def log_file(self, path, folder=None):
        if not path.endswith(".png"):
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        data = Path(path).read_bytes()
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # PNG IHDR
        image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=data)
        self._write([Summary.Value(tag=Path(path).stem, image=image)], 0)

    def close(self, ok):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tensorboard_points(logdir: Path) -> set[tuple[str, int]]:
    """(tag, step) of every scalar point in the event files directly in `logdir` (a truncated last record, the
    mark of a killed writer, ends its file's read)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    points: set[tuple[str, int]] = set()
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():  # as written: simple_value not made a tensor
            points.update((v.tag, event.step) for v in event.summary.value if v.WhichOneof("value") == "simple_value")
    return points


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client = None
        self.run_id: str | None = None
        self.logged: set[tuple[str, int]] = set()  # (key, step) points a continued run already holds

    def problem(self):
        return mlflow_problem(self.uri)

    def open(self, state, params, tags):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(f"tracking backend 'mlflow' is not installed: {EXTRA}") from exc
        self.client = MlflowClient(tracking_uri=self.uri)
        run_id = state.get("mlflow_run_id")
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.lifecycle_stage == "deleted":
                    run_id = None
            except Exception:  # noqa: BLE001 - gone (another tracking URI, deleted): start a new run
                run_id = None
        if not run_id:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = (
                exp.experiment_id
                if exp
                else self.client.create_experiment(
                    self.experiment, artifact_location=mlflow_artifact_location(self.uri)
                )
            )
            run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
            state["mlflow_run_id"] = run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
            # A kill can land after MLflow took a committed row and before tracking.json recorded it: the resume
            # logs that row again, and MLflow would keep both copies (its points differ by timestamp).
            self.logged = {
                (key, point.step)
                for key in self.client.get_run(run_id).data.metrics
                for point in self.client.get_metric_history(run_id, key)
            }
        self.run_id = run_id
        if params is not None:
            items = [Param(mlflow_key(k)[:250], str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
        for key, value in tags.items():
            self.client.set_tag(run_id, mlflow_key(key), str(value)[:5000])

    def log(self, metrics, step):
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        items = [
            Metric(key, v, stamp, step)
            for key, v in ((mlflow_key(k), v) for k, v in metrics.items())
            if (key, step) not in self.logged
        ]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_text(self, key, text, step=0):
        self.client.log_text(self.run_id, text, f"{mlflow_key(key)}.md")

    def log_file(self, path, folder=None):
        self.client.log_artifact(self.run_id, path, folder)

    def set_summary(self, values):
        for key, value in values.items():
            self.client.set_tag(self.run_id, mlflow_key(f"summary.{key}"), str(value)[:5000])

    def close(self, ok):
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, project: str, run_name: str, folder: Path, mode: str | None):
        self.project, self.run_name, self.folder, self.mode = project, run_name, folder, mode
        self.run = None
        self.defined: set[str] = set()  # keys given their x-axis (define_metric) in this process

    def open(self, state, params, tags):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"tracking backend 'wandb' is not installed: {EXTRA}") from exc
        run_id = state.get("wandb_run_id") or uuid.uuid4().hex[:8]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=self.run_name,
            id=run_id,
            resume="allow",
            dir=str(self.folder),
            mode=self.mode or os.environ.get("WANDB_MODE") or "online",
            config=params,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        state["wandb_run_id"] = self.run.id
        if tags:
            self.run.summary.update(dict(tags))

    def log(self, metrics, step):
        # W&B has one history step per run and drops a step that goes back, so the optimizer steps
        # (train_step/*) and the iteration rows cannot share it: each key is charted against its own
        # x-axis metric (define_metric), logged in the same row, and W&B's own _step just counts rows.
        axis = STEP_AXIS if all(k.startswith(STEP_PREFIX) for k in metrics) else ROW_AXIS
        for key in metrics:
            if key not in self.defined:
                if axis not in self.defined:
                    self.run.define_metric(axis, hidden=True)
                    self.defined.add(axis)
                self.run.define_metric(key, step_metric=axis)
                self.defined.add(key)
        self.run.log({**metrics, axis: step})

    def log_text(self, key, text, step=0):
        path = Path(self.run.dir) / f"{key.replace('/', '_')}.md"
        path.write_text(text)
        self.run.save(str(path), base_path=self.run.dir, policy="now")

    def log_file(self, path, folder=None):
        self.run.save(path, base_path=str(Path(path).parent), policy="now")

    def set_summary(self, values):
        self.run.summary.update(dict(values))

    def close(self, ok):
        if self.run is not None:
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None


# ---- the tracker a flow holds -------------------------------------------------------------------------------


class Tracker:
    """The run's sinks; every call goes to each live sink, and a sink that raises is dropped (once, with a
    warning) unless `tracking.fatal`. With no backends configured every method is a no-op."""

    def __init__(self, cfg: RunConfig, sinks: list[Sink], state: dict, state_path: str | None):
        self.cfg = cfg
        self.sinks = sinks
        self.state = state
        self.state_path = state_path
        self.disabled: dict[str, str] = {}

    @property
    def active(self) -> bool:
        return bool(self.sinks)

    def _each(self, what: str, fn: Callable[[Sink], Any]) -> None:
        for sink in list(self.sinks):
            try:
                fn(sink)
            except Exception as exc:  # noqa: BLE001 - logging never fails training (unless fatal)
                self._drop(sink, what, exc)

    def _drop(self, sink: Sink, what: str, exc: BaseException) -> None:
        if isinstance(exc, ImportError) and str(exc).startswith("tracking backend"):
            message = str(exc)  # one line naming the extra
            line = f"{message}; tracking to {sink.name} is off for this run"
        else:
            if isinstance(exc, TrackingUnusable):
                message = f"tracking backend {sink.name!r} cannot work: {exc}"
            else:
                message = f"tracking backend {sink.name!r} failed ({what}): {type(exc).__name__}: {exc}"
            line = (
                f"{message}; it is disabled for this run, training goes on (tracking.fatal=true fails the run instead)"
            )
        if self.cfg.tracking.fatal:
            raise TrackingError(message) from exc
        if sink in self.sinks:
            self.sinks.remove(sink)
            if what not in ("finish", "check"):  # a sink found unusable was never opened
                try:
                    sink.close(False)  # best effort: mark its run failed, release files and processes
                except Exception:  # noqa: BLE001
                    pass
        self.disabled[sink.name] = message
        report_problem(line)

    def check(self) -> "Tracker":
        """Drop (or, with `tracking.fatal`, fail on) each sink that cannot work, with one line each."""
        for sink in list(self.sinks):
            problem = sink.problem()
            if problem:
                self._drop(sink, "check", TrackingUnusable(problem))
        return self

    def open(self, params: dict[str, Any] | None, tags: dict[str, str]) -> "Tracker":
        self._each("start", lambda s: s.open(self.state, params, tags))
        self.save_state()
        return self

    def log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._each(f"log step {step}", lambda s: s.log(metrics, step))

    def log_rows(self, rows: Iterable[dict], step_key: str = "iteration") -> None:
        for row in rows:
            self.log(numeric_metrics({k: v for k, v in row.items() if k != step_key}), int(row[step_key]))

    def log_text(self, key: str, text: str, step: int = 0) -> None:
        self._each(f"log {key}", lambda s: s.log_text(key, text, step))

    def log_file(self, path: str | None, folder: str | None = None) -> None:
        """A file of the run (the reward curve, a report). Non-local files are skipped."""
        if not path or not Path(path).exists():
            return
        self._each(f"log {Path(path).name}", lambda s: s.log_file(path, folder))

    def set_summary(self, values: dict[str, Any]) -> None:
        self._each("summary", lambda s: s.set_summary(values))

    def save_state(self) -> None:
        if not self.state_path or not self.sinks:
            return
        try:
            fs, path = open_fs(self.state_path)
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with fs.open(path, "w") as f:
                f.write(json.dumps(self.state, sort_keys=True, indent=1))
        except Exception as exc:  # noqa: BLE001
            if self.cfg.tracking.fatal:
                raise TrackingError(f"tracking state {self.state_path}: {exc}") from exc
            report_problem(
                f"could not write the tracking state {self.state_path} ({exc}); a resume starts new tracking runs"
            )

    def close(self, ok: bool = True) -> None:
        self._each("finish", lambda s: s.close(ok))
        self.sinks.clear()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close(ok=exc_type is None)
        except TrackingError:
            if exc_type is None:
                raise


def read_state(path: str) -> dict:
    try:
        fs, p = open_fs(path)
        fs.invalidate_cache(p)
        if not fs.exists(p):
            return {}
        return json.loads(fs.cat_file(p).decode())
    except Exception as exc:  # noqa: BLE001 - an unreadable state file: new tracking runs
        report_problem(f"tracking state {path} is unreadable ({exc}); starting new tracking runs")
        return {}


def state_path(cfg: RunConfig, *parts: str) -> str:
    return posixpath.join(RolloutStore(cfg.store.root).run_uri(cfg.run), *parts, STATE_FILE)


def prefect_tags() -> dict[str, str]:
    """The current Prefect flow run (id, name, UI link), when there is one."""
    try:
        from prefect.runtime import flow_run

        out = {"prefect.flow_run_id": str(flow_run.id or ""), "prefect.flow_run_name": str(flow_run.name or "")}
        url = flow_run.ui_url
        if url:
            out["prefect.flow_run_url"] = str(url)
        return {k: v for k, v in out.items() if v}
    except Exception:  # noqa: BLE001
        return {}


def build_sinks(cfg: RunConfig, flow: str, run_name: str, tb_folder: str | None = None) -> list[Sink]:
    t = cfg.tracking
    sinks: list[Sink] = []
    for backend in t.backends:
        if backend == "tensorboard":
            sinks.append(TensorBoardSink(tracking_dir(cfg) / "tensorboard" / (tb_folder or flow)))
        elif backend == "mlflow":
            sinks.append(MlflowSink(mlflow_uri(cfg), t.experiment or t.project, run_name))
        elif backend == "wandb":
            sinks.append(WandbSink(t.project, run_name, tracking_dir(cfg), t.wandb_mode))
    return sinks


def start(
    cfg: RunConfig,
    flow: str,
    *,
    suffix: str = "",
    state_at: str | None = None,
    state: dict | None = None,
    links: dict[str, str] | None = None,
) -> Tracker:
    """A tracker for one flow run: `state_at` (a tracking.json URL) keeps run ids across runs (resume, nights)."""
    if not cfg.tracking.backends:
        return Tracker(cfg, [], {}, None)
    name = (cfg.tracking.run_name or cfg.run) + suffix
    if state is None:
        state = read_state(state_at) if state_at else {}
    fresh = not (state.get("mlflow_run_id") or state.get("wandb_run_id"))
    tags = {"rollflow.run": cfg.run, "rollflow.flow": flow, **prefect_tags(), **(links or {})}
    # without kept state each call is a tracking run of its own: TensorBoard gets a folder per call
    folder = state.get(TB_FOLDER) if state_at else f"{flow}/{time.strftime('%Y%m%dT%H%M%S')}"
    tracker = Tracker(cfg, build_sinks(cfg, flow, name, folder), state, state_at).check()
    return tracker.open(config_params(cfg) if fresh else None, tags)


# ---- per flow ---------------------------------------------------------------------------------------------


def start_train(cfg: RunConfig, resume_at: int) -> Tracker:
    """rl_train's tracker: the stored tracking run continues when it holds no step past `resume_at` (the
    checkpoint the run resumes from); committed rows it has not seen yet are logged now."""
    if not cfg.tracking.backends:
        return Tracker(cfg, [], {}, None)
    where = state_path(cfg)
    state = read_state(where)
    if int(state.get("logged_through", 0)) > resume_at:
        # resume_from an older checkpoint: the old tracking run has steps that will be redone
        report_problem(
            f"run {cfg.run!r} resumes from checkpoint {resume_at}, before the last step its tracking "
            f"run logged ({state['logged_through']}): logging to new tracking runs"
        )
        # TensorBoard too: a folder of its own, or the redone steps would sit beside the old ones
        state = {TB_FOLDER: f"rl_train/resumed-{resume_at}-{time.strftime('%Y%m%dT%H%M%S')}"}
    state.setdefault("logged_through", 0)
    run_uri = RolloutStore(cfg.store.root).run_uri(cfg.run)
    links = {
        "rollflow.store": run_uri,
        "rollflow.checkpoints": f"{run_uri}/checkpoints/",
        "rollflow.metrics": reporting.run_file(cfg, "metrics.jsonl")[1],
    }
    if resume_at:
        links["rollflow.resumed_from"] = str(resume_at)
    tracker = start(cfg, "rl_train", state_at=where, state=state, links=links)
    log_committed(tracker, cfg, resume_at)
    return tracker


def log_committed(tracker: Tracker, cfg: RunConfig, committed: int) -> None:
    """Rows of metrics.jsonl up to iteration `committed` (a committed checkpoint) not logged yet."""
    if not tracker.active:
        return
    done = int(tracker.state.get("logged_through", 0))
    if committed <= done:
        return
    rows = [r for r in reporting.read_metrics(cfg) if done < r["iteration"] <= committed]
    tracker.log_rows(rows)
    log_steps(tracker, [r for r in reporting.read_train_steps(cfg) if done < r["iteration"] <= committed])
    if rows and rows[-1].get("rollout_uri"):
        tracker._each("tags", lambda s: s.set_summary({"last_rollout_uri": rows[-1]["rollout_uri"]}))
    tracker.state["logged_through"] = committed
    tracker.save_state()


def log_steps(tracker: Tracker, rows: Iterable[dict]) -> None:
    """Rows of optimizer steps (`step` plus `train_step/*` keys; any other field is context, not a metric)."""
    for row in rows:
        tracker.log({k: float(v) for k, v in row.items() if k.startswith(STEP_PREFIX)}, int(row["step"]))


def checkpointed(cfg: RunConfig, iteration: int) -> bool:
    """Whether rl_iteration commits a checkpoint after `iteration` (flows/iteration.py's rule)."""
    return iteration % cfg.checkpoint_every == 0 or iteration == cfg.iterations


CHECK_STATUS = {"pass": 1.0, "warn": 0.5, "fail": 0.0}


def alignment_metrics(report: dict) -> dict[str, float]:
    """One row of an alignment report: `alignment/{check}/status` (pass 1, warn 0.5, fail 0) and each
    numeric figure as `alignment/{check}/{figure}`."""
    out: dict[str, float] = {}
    for check in report.get("checks", []):
        out[f"alignment/{check['name']}/status"] = CHECK_STATUS.get(check["status"], 0.0)
        for key, value in (check.get("figures") or {}).items():
            if isinstance(value, (bool, int, float)) and not isinstance(value, str):
                out[f"alignment/{check['name']}/{key}"] = float(value)
    return out


def log_alignment(cfg: RunConfig, report: dict, json_path: str) -> None:
    """One point per check figure per alignment run, in one long-lived tracking run `{name}-alignment` (its
    ids in `{store.root}/{run}/alignment/tracking.json`), so the nightly trend is a chart."""
    if not cfg.tracking.backends:
        return
    where = state_path(cfg, "alignment")
    state = read_state(where)
    step = int(state.get("next_step", 0))
    tracker = start(cfg, "alignment_check", suffix="-alignment", state_at=where, state=state)
    with tracker:
        tracker.log(alignment_metrics(report), step)
        local = json_path if Path(json_path).exists() else None
        tracker.log_file(local, "alignment")
        tracker.set_summary({"alignment.status": report.get("status"), "alignment.report": json_path})
        tracker.state["next_step"] = step + 1
        tracker.save_state()
