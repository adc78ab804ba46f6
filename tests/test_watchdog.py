"""Stall deadlines (issue 35, docs/checks.md): a wait on an actor that stops making progress fails within the
deadline with one line naming the task, the actor, the seconds and the stack file; the actor is killed; a slow
call that keeps making progress is left alone."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rollflow.infra.deadline import StallError, StallWatch, stacks_uri, wait, watching
from rollflow.infra.stacks import own_stacks
from rollflow.infra.workers import CONTROL, start_actor, stop_actor
from rollflow.tasks.progress import Progress


class Plodder:
    """A worker whose `work` ticks its counter every `step_s` for `steps` steps."""

    def __init__(self) -> None:
        self._progress = Progress()

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def progress(self) -> int:
        return self._progress.value

    def work(self, steps: int, step_s: float) -> int:
        for _ in range(steps):
            time.sleep(step_s)
            self._progress.tick()
        return steps


def _watch(tmp_path, run: str, stall_s: float) -> StallWatch:
    return StallWatch(
        run=run,
        task="generate",
        iteration=3,
        stall_s=stall_s,
        stacks_uri=stacks_uri(str(tmp_path), run, 3, "generate"),
        poll_s=0.2,
    )


def test_progress_counter_is_safe_across_threads():
    progress = Progress()
    threads = [threading.Thread(target=lambda: [progress.tick() for _ in range(10_000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert progress.value == 40_000


def test_no_watch_is_a_plain_get(ray_local):
    actor = start_actor("wd-plain", "engine", Plodder)
    try:
        assert wait(actor.work.remote(2, 0.01)) == 2
        assert wait([actor.work.remote(1, 0.0), actor.pid.remote()])[0] == 1
    finally:
        stop_actor("wd-plain", "engine")


def test_slow_call_that_progresses_is_not_a_stall(ray_local, tmp_path):
    """9 s of work ticking every 0.3 s under a 3 s deadline: no stall. (The deadline leaves a busy 2-core box, where
    a nice-15 Ray worker can wait over a second for the CPU, ten ticks of margin.)"""
    actor = start_actor("wd-slow", "engine", Plodder)
    try:
        with watching(_watch(tmp_path, "wd-slow", 3.0)):
            assert wait(actor.work.remote(30, 0.3)) == 30
        assert not (tmp_path / "wd-slow" / "stalls").exists()
    finally:
        stop_actor("wd-slow", "engine")


def test_stopped_actor_stalls_with_stacks_and_is_killed(ray_local, tmp_path):
    """SIGSTOP of the actor's process mid-call: StallError within the deadline (+ capture), one line, the stack file
    names the stopped actor and its frames, and the actor is gone."""
    import ray

    run = "wd-stop"
    actor = start_actor(run, "engine", Plodder)
    start_actor(run, "trainer", Plodder)  # an idle actor of the same run: its stacks are captured too
    pid = ray.get(actor.pid.remote())
    try:
        ref = actor.work.remote(10_000, 0.05)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with watching(_watch(tmp_path, run, 3.0)), pytest.raises(StallError) as caught:
            wait(ref)
        took = time.monotonic() - started
        assert took < 3.0 + 30, took
        err = caught.value
        assert err.actor == f"{run}:engine" and err.task == "generate" and err.seconds >= 3.0
        message = str(err)
        assert "\n" not in message and "generate" in message and f"{run}:engine" in message
        assert err.stack_file in message and err.stack_file.endswith(f"{run}/stalls/3-generate.txt")
        text = open(err.stack_file).read()
        assert f"=== {run}:engine (pid {pid}" in text and f"=== {run}:trainer" in text and "flow process" in text
        section = text.split(f"=== {run}:engine", 1)[1].split("\n=== ", 1)[0]
        assert "work (" in section and "test_watchdog.py" in section, section  # the stopped actor's own frame
        assert "blamed and killed: " + f"{run}:engine" in text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                ray.get_actor(f"{run}:engine", namespace="rollflow")
            except ValueError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the stalled actor was not killed")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_actor(run, "engine")
        stop_actor(run, "trainer")


def test_stopped_dependency_is_blamed(ray_local, tmp_path):
    """The awaited actor waits (answering, no progress) on a call of a stopped one: the stopped one is blamed."""
    import ray

    run = "wd-dep"
    waiter = start_actor(run, "engine", Plodder)
    stuck = start_actor(run, "trainer", Plodder)
    pid = ray.get(stuck.pid.remote())
    try:
        os.kill(pid, signal.SIGSTOP)
        ref = waiter.work.remote(1, 0.0)
        blocked = stuck.work.remote(1, 0.0)
        with watching(_watch(tmp_path, run, 2.0)), pytest.raises(StallError) as caught:
            wait([ref, blocked])
        assert caught.value.actor == f"{run}:trainer"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_actor(run, "engine")
        stop_actor(run, "trainer")


def test_stall_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(StallError("train", "r:trainer", 21.4, "runs/r/stalls/2-train.txt")))
    assert isinstance(err, StallError) and err.actor == "r:trainer" and "21 s" in str(err)


def test_own_stacks_name_this_thread():
    stacks = own_stacks()
    assert stacks.pid == os.getpid() and "test_own_stacks_name_this_thread" in stacks.text


def test_control_group_answers_progress_while_busy(ray_local):
    import ray

    actor = start_actor("wd-ctl", "engine", Plodder)
    try:
        ref = actor.work.remote(600, 0.05)  # 30 s of work; the test ends it (stop_actor) once it has its answers
        # Poll until two different counts came back mid-work (a loaded box may start the work late). Were
        # `progress` queued behind `work` (the default group runs one call at a time), the first get would time out.
        readings: list[int] = []
        deadline = time.monotonic() + 20
        while len(set(readings) - {0}) < 2 and time.monotonic() < deadline:
            readings.append(ray.get(actor.progress.options(concurrency_group=CONTROL).remote(), timeout=5))
            time.sleep(0.1)
        assert len(set(readings) - {0}) >= 2, readings
        assert readings == sorted(readings) and readings[-1] < 600
        assert not ray.wait([ref], timeout=0)[0]  # the answers came while `work` was still running
    finally:
        stop_actor("wd-ctl", "engine")


# ---------------------------------------------------------------- end to end: a real `rollflow train`, SIGSTOP


def _session_procs(sid: int, marker: str) -> list[int]:
    """Pids in the session `sid` (the train command's, started with start_new_session) whose cmdline has `marker`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        if cmdline.startswith(f"ray::{marker}"):
            out.append(int(entry))
    return out


def _train_until(
    tmp_path,
    prefect_api,
    run: str,
    marker: str,
    after: str,
    extra: list[str],
    settle_s: float = 0.0,
    iterations: int = 3,
) -> tuple[str, list[int]]:
    """`rollflow train` (`iterations`, watchdog.stall_s=20); SIGSTOP the `marker` actor `settle_s` after `after` exists
    under the run; returns the output and the stopped pids. The run must complete."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
    sets = [
        f"run={run}",
        f"iterations={iterations}",
        f"store.root={tmp_path}",
        "data.prompts_per_rollout=16",
        "rollout.n_samples_per_prompt=4",
        "train.num_steps_per_rollout=1",
        "watchdog.stall_s=20",
        "watchdog.probe_every=0",
        *extra,
    ]
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / run / after).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(settle_s)
        stopped = _session_procs(proc.pid, marker)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        output = proc.communicate(timeout=480)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)  # the stopped process, if the watchdog left it
            except ProcessLookupError:
                pass
    assert stopped, f"no ray::{marker} process found"
    assert proc.returncode == 0, output[-4000:]
    return output, stopped


def _one_stall_line(output: str, task: str, actor: str) -> str:
    lines = [line for line in output.splitlines() if f"task {task} stalled: actor {actor}" in line]
    assert lines, output[-4000:]
    return lines[0]


@pytest.mark.slow
def test_e2e_engine_stopped_during_generate(tmp_path, prefect_api):
    """SIGSTOP of the rollout worker after checkpoint 1: iteration 2's generate stalls, fails with the one line,
    its retry restarts the engine and the run completes."""
    run = "wd-gen"
    output, pids = _train_until(tmp_path, prefect_api, run, "RolloutWorker", "checkpoints/000001/meta.json", [])
    line = _one_stall_line(output, "generate", f"{run}:engine")
    stack_file = tmp_path / run / "stalls" / "2-generate.txt"
    assert str(stack_file) in line or "stalls/2-generate.txt" in line
    text = stack_file.read_text()
    assert f"=== {run}:engine (pid {pids[0]}" in text and "rollout" in text
    metrics = [line for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) == 3


@pytest.mark.slow
def test_e2e_engine_stopped_before_sync(tmp_path, prefect_api):
    """SIGSTOP of the rollout worker once rollout 0 is committed (the trainer trains): the sync stalls, its retry
    restarts the engine from the trainer's weights and the run completes."""
    run = "wd-sync"
    output, _ = _train_until(tmp_path, prefect_api, run, "RolloutWorker", "rollouts/train/000000/manifest.json", [])
    _one_stall_line(output, "sync", f"{run}:engine")
    assert (tmp_path / run / "stalls" / "1-sync.txt").exists()


@pytest.mark.slow
def test_e2e_trainer_stopped_resumes_from_checkpoint(tmp_path, prefect_api):
    """SIGSTOP of the trainer inside iteration 2's (the last) train call: debug.slow_train_s makes every train call
    spend 30 s ticking its progress (longer than stall_s, so iteration 1 also shows a slow call that progresses is
    no stall), and the stop lands 5 s after rollout 1 is committed. The train task stalls, the run fails that flow
    run attempt, and rl_train's retry (retries=1) resumes from checkpoint 1 with a fresh trainer."""
    run = "wd-train"
    # the fault's trainer class names the process: ray::SlowTrainWorker
    output, _ = _train_until(
        tmp_path,
        prefect_api,
        run,
        "SlowTrainWorker",
        "rollouts/train/000001/manifest.json",
        ["retries=1", "debug.slow_train_s=30"],
        settle_s=5,
        iterations=2,
    )
    _one_stall_line(output, "train", f"{run}:trainer")
    assert (tmp_path / run / "stalls" / "2-train.txt").exists()
    metrics = [line for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) == 2


def test_stacks_of_an_actor_on_another_node_are_read_on_that_node(ray_local):
    """On a cluster py-spy must run where the stalled actor runs: a Ray task pinned to the actor's node dumps it.
    One node here, so the route is forced by naming another node as the flow's; the stacks still show the busy
    actor's own frame. On the flow's own node the dump stays local."""
    from rollflow.infra.deadline import _run_actors, dump_rows

    run = "wd-remote"
    actor = start_actor(run, "engine", Plodder)
    try:
        actor.work.remote(400, 0.05)
        time.sleep(0.5)
        (row,) = _run_actors(run)
        node = row["Address"]["NodeID"]
        (remote,) = dump_rows([row], here="another-node")
        assert remote.how.startswith("py-spy") and remote.how.endswith(f"on node {node}"), remote
        assert remote.pid == int(row["Pid"]) and "work (" in remote.text and "test_watchdog.py" in remote.text
        (local,) = dump_rows([row], here=node)
        assert local.how.startswith("py-spy") and "on node" not in local.how
    finally:
        stop_actor(run, "engine")


def test_a_dump_on_a_node_that_is_gone_says_why(ray_local):
    """A dead node (or a cut link) answers no dump: the stack file then says why, and the stall still fails."""
    from rollflow.infra.stacks import collect_dump, submit_dump

    gone = "ab" * 28  # a well-formed node id of no node
    started = time.monotonic()
    stacks = collect_dump(submit_dump(os.getpid(), "x", gone), os.getpid(), "x", gone, timeout=20)
    assert stacks.how == "not captured" and stacks.text.startswith(f"dump task on node {gone}: "), stacks
    assert time.monotonic() - started < 15  # refused at once: no wait for the timeout
