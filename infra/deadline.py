"""Stall deadlines: a wait on actor calls that tells a slow call from a stuck one (docs/checks.md).

Every wait of the typed clients goes through `wait` (infra/clients.py `_get`). Under a `StallWatch` (set by the
flow layer around a task, `watching`), the wait runs `ray.wait` in short slices; each slice it asks the actors
running the awaited calls for their `progress()` in their control group (it answers while the call runs). A call
whose actor shows no progress for `stall_s` is stalled (a stopped process does not answer at all, which counts as
no progress): the stacks of every actor of the run and of this process go to the watch's stack file, the stuck
actor is killed, and `StallError` says which task, actor, how long and where the stacks are. The flow layer
publishes the report and lets the task's retry policy apply.

Without a watch (tests, benchmarks, tools) or with `stall_s == 0` a wait is a plain `ray.get`. A call that
finishes within the first slice costs one `ray.wait` more than `ray.get`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import posixpath
import time
from typing import Any, Iterator

from rollflow.artifacts.storage import open_fs
from rollflow.infra.stacks import REMOTE_DUMP_TIMEOUT_S, ProcessStacks, collect_dump, dump_pid, own_stacks, submit_dump
from rollflow.infra.workers import CONTROL, NAMESPACE

PING_TIMEOUT_S = 5.0  # how long an actor of the run may take to answer a ping when a stall is being blamed


@dataclasses.dataclass(frozen=True)
class StallWatch:
    """What a wait under a task watches for: `stall_s` seconds without progress of the awaited actors.

    `stacks_uri`: the stack file of a stall (`{store root}/{run}/stalls/{iteration}-{task}.txt`)."""

    run: str
    task: str
    iteration: int
    stall_s: float
    stacks_uri: str
    storage_options: dict[str, Any] | None = None
    poll_s: float = 1.0

    @property
    def slice_s(self) -> float:
        # Several polls per deadline, so a stall is caught within about stall_s + one slice.
        return max(0.05, min(self.poll_s, self.stall_s / 4))


def stacks_uri(store_root: str, run: str, iteration: int, task: str) -> str:
    return posixpath.join(store_root.rstrip("/"), run, "stalls", f"{iteration}-{task}.txt")


class StallError(RuntimeError):
    """An awaited actor made no progress for the deadline; it was killed and its stacks written."""

    def __init__(self, task: str, actor: str, seconds: float, stack_file: str, *, killed: bool = True, node: str = ""):
        self.task, self.actor, self.seconds, self.stack_file = task, actor, seconds, stack_file
        self.killed, self.node = killed, node
        action = "killed it" if killed else "could not kill it"
        # on a cluster the node is the lead: a cut link or a dead host stalls every actor on it
        where = f" on node {node}" if node else ""
        super().__init__(
            f"task {task} stalled: actor {actor}{where} made no progress for {seconds:.0f} s ({action}); "
            f"stacks of every actor: {stack_file}"
        )

    def __reduce__(self):  # Prefect and Ray pickle exceptions: rebuild from the fields
        return (_rebuild_stall, (self.task, self.actor, self.seconds, self.stack_file, self.killed, self.node))


def _rebuild_stall(task: str, actor: str, seconds: float, stack_file: str, killed: bool, node: str) -> StallError:
    return StallError(task, actor, seconds, stack_file, killed=killed, node=node)


# The watch of the task running in this context (a Prefect task sets it; submitted tasks get a copy of the context).
WATCH: contextvars.ContextVar[StallWatch | None] = contextvars.ContextVar("rollflow_stall_watch", default=None)


@contextlib.contextmanager
def watching(watch: StallWatch | None) -> Iterator[None]:
    token = WATCH.set(watch)
    try:
        yield
    finally:
        WATCH.reset(token)


@dataclasses.dataclass
class _Watched:
    """One actor running an awaited call: its last progress value and when it last moved."""

    name: str
    actor_id: str
    pid: int
    handle: Any
    since: float
    value: int | None = None
    probe: Any = None  # the progress() call in flight (a stopped actor never answers it)

    def poll(self, now: float) -> None:
        import ray

        if self.probe is not None:
            ready, _ = ray.wait([self.probe], timeout=0)
            if not ready:
                return  # no answer yet: no progress
            try:
                value = int(ray.get(self.probe))
            except Exception:  # noqa: BLE001 - an actor that cannot answer makes no progress
                value = None
            if value is not None and value != self.value:
                self.value, self.since = value, now
        self.probe = self.handle.progress.options(concurrency_group=CONTROL).remote()


def actor_table(actor_id: str | None = None) -> list[dict[str, Any]]:
    # The GCS actor table (names, pids, nodes, states); the state API would need the dashboard.
    from ray._private import state

    table = state.actors(actor_id=actor_id) if actor_id else state.actors()
    rows = [table] if actor_id else list(table.values())
    return [r for r in rows if r]


def _watched(refs: list[Any], now: float) -> list[_Watched]:
    """The named actors running the calls of `refs` (plain tasks and `ray.put` objects have none)."""
    import ray

    out: dict[str, _Watched] = {}
    for ref in refs:
        actor_id = ref.task_id().actor_id()
        if actor_id.is_nil() or actor_id.hex() in out:
            continue
        rows = actor_table(actor_id.hex())
        if not rows or not rows[0].get("Name"):
            continue
        row = rows[0]
        try:
            handle = ray.get_actor(row["Name"], namespace=NAMESPACE)
        except ValueError:
            continue  # gone already: the wait itself fails next
        out[actor_id.hex()] = _Watched(row["Name"], actor_id.hex(), int(row["Pid"]), handle, now)
    return list(out.values())


def _starting(actor: _Watched) -> bool:
    """Still in its constructor (or restarting): its progress() cannot run yet, which is no stall."""
    rows = actor_table(actor.actor_id)
    return bool(rows) and rows[0]["State"] != "ALIVE"


def wait(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get(refs, timeout)` under the context's stall watch (see the module docstring)."""
    import ray

    watch = WATCH.get()
    many = isinstance(refs, list)
    pending = list(refs) if many else [refs]
    if (
        watch is None
        or watch.stall_s <= 0
        or not pending
        or not all(isinstance(r, ray.ObjectRef) for r in pending)
        or len(set(pending)) != len(pending)
    ):
        return ray.get(refs, timeout=timeout)
    start = time.monotonic()
    budget = watch.slice_s if timeout is None else min(watch.slice_s, timeout)
    _, pending = ray.wait(pending, num_returns=len(pending), timeout=budget)
    watched: list[_Watched] | None = None
    while pending:
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            return ray.get(refs, timeout=0)  # raises GetTimeoutError as a plain ray.get would
        if watched is None:
            watched = _watched(pending, now)
        for actor in watched:
            actor.poll(now)
        stalled = [a for a in watched if now - a.since >= watch.stall_s and not _starting(a)]
        for actor in watched:
            if actor not in stalled and now - actor.since >= watch.stall_s:
                actor.since = now  # it was starting: its deadline counts from now
        if stalled:
            raise _stall(watch, stalled, now)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=watch.slice_s)
    return ray.get(refs)


def _run_actors(run: str) -> list[dict[str, Any]]:
    prefix = f"{run}:"
    return [r for r in actor_table() if r.get("State") == "ALIVE" and str(r.get("Name") or "").startswith(prefix)]


def _frozen(rows: list[dict[str, Any]]) -> set[str]:
    """The actors of `rows` that do not answer a ping in their control group (stopped, hung in C, dead)."""
    import ray

    probes = {}
    for row in rows:
        try:
            probes[row["Name"]] = (
                ray.get_actor(row["Name"], namespace=NAMESPACE).ping.options(concurrency_group=CONTROL).remote()
            )
        except ValueError:
            continue
    ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=PING_TIMEOUT_S) if probes else ([], [])
    answered = set()
    for name, ref in probes.items():
        if ref in ready:
            try:
                ray.get(ref)
                answered.add(name)
            except Exception:  # noqa: BLE001 - a failed ping is no answer
                pass
    return {row["Name"] for row in rows} - answered


def _stall(watch: StallWatch, stalled: list[_Watched], now: float) -> StallError:
    """Blame, capture, write, kill: the error to raise."""
    import ray

    rows = _run_actors(watch.run)
    frozen = _frozen(rows)
    # A stopped actor stalls everyone waiting on it (an engine waits for the trainer's weights): blame it first.
    blamed_name = next(
        (a.name for a in stalled if a.name in frozen),
        next((r["Name"] for r in rows if r["Name"] in frozen), stalled[0].name),
    )
    seconds = max(now - a.since for a in stalled)
    header = [
        f"task {watch.task} of run {watch.run}, iteration {watch.iteration}: no progress for {seconds:.0f} s "
        f"(watchdog.stall_s={watch.stall_s:g})",
        "awaited: "
        + ", ".join(
            f"{a.name} (pid {a.pid}, {now - a.since:.0f} s without progress, last progress value {a.value})"
            for a in stalled
        ),
        f"not answering a ping within {PING_TIMEOUT_S:g} s: {', '.join(sorted(frozen)) or 'none'}",
        f"blamed and killed: {blamed_name}",
        "",
    ]
    stacks = dump_rows(rows, ray.get_runtime_context().get_node_id()) + [own_stacks()]
    text = "\n".join(header) + "\n" + "\n".join(s.render() for s in stacks)
    stack_file = _write(watch, text)
    killed = True
    try:
        ray.kill(ray.get_actor(blamed_name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        killed = False
    return StallError(watch.task, blamed_name, seconds, stack_file, killed=killed, node=node_of(rows, blamed_name))


def node_of(rows: list[dict[str, Any]], name: str) -> str:
    """'<ip> (<node id>)' of the actor `name`, '' when the table has no such row."""
    row = next((r for r in rows if r.get("Name") == name), None)
    address = (row or {}).get("Address") or {}
    if not address.get("NodeID"):
        return ""
    return f"{address.get('IPAddress', '?')} ({address['NodeID']})"


def dump_rows(rows: list[dict[str, Any]], here: str) -> list[ProcessStacks]:
    """Stacks of the actors of `rows`, in order: py-spy in this process for those on node `here`, a task pinned to
    its node for each of the others (started together first, so a dead node costs one timeout, not one each)."""
    remote = {
        i: submit_dump(int(row["Pid"]), row["Name"], row["Address"]["NodeID"])
        for i, row in enumerate(rows)
        if row["Address"]["NodeID"] != here
    }
    out = [dump_pid(int(row["Pid"]), row["Name"]) if i not in remote else None for i, row in enumerate(rows)]
    until = time.monotonic() + REMOTE_DUMP_TIMEOUT_S
    for i, ref in remote.items():
        row = rows[i]
        out[i] = collect_dump(ref, int(row["Pid"]), row["Name"], row["Address"]["NodeID"], until - time.monotonic())
    return [s for s in out if s is not None]


def _write(watch: StallWatch, text: str) -> str:
    """The report into the stack file; where it went (or why not, so the error still names the stacks)."""
    try:
        fs, path = open_fs(watch.stacks_uri, watch.storage_options)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "w") as f:
            f.write(text)
    except Exception as exc:  # noqa: BLE001 - a failed write must not hide the stall itself
        return f"{watch.stacks_uri} (not written: {type(exc).__name__}: {exc})"
    return watch.stacks_uri
