"""One active flow run per rollflow run name: a second one fails at once with a message, and does not touch
the first one's actors or artifacts (a real Prefect API; the limit is Prefect's global concurrency limit)."""

from __future__ import annotations

import pytest


def test_second_run_of_a_name_is_refused_while_the_first_holds_it(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    from rollflow.flows.config import RunConfig
    from rollflow.flows.debug import rollout_only
    from rollflow.flows.prefect_ops.run_lock import RunBusy, exclusive_run, limit_name

    cfg = RunConfig(run="busy-run", store={"root": str(tmp_path)})
    with exclusive_run("busy-run"):  # the first run of this name is active
        with pytest.raises(RunBusy, match="run 'busy-run' is active in another flow run"):
            rollout_only(cfg, rollout_ids=[0])
        with get_client(sync_client=True) as client:
            held = client.read_global_concurrency_limit_by_name(limit_name("busy-run"))
        assert held.limit == 1 and held.active_slots == 1
    assert not (tmp_path / "busy-run").exists()  # the refused run wrote nothing and started no engine
    # released: the next run of the name gets the slot
    with exclusive_run("busy-run", wait_s=2):
        pass
    # other names are independent
    with exclusive_run("busy-run"), exclusive_run("other-run", wait_s=2):
        pass


def test_a_killed_holder_is_reclaimed_at_once(prefect_api, tmp_path):
    """kill -9 of the run holding the name, then the same command again: no wait for the lease to expire."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom rollflow.flows.prefect_ops.run_lock import exclusive_run\n"
            "with exclusive_run('killed-run'):\n    print('HELD', flush=True)\n    time.sleep(600)\n",
        ],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    from rollflow.flows.prefect_ops.run_lock import exclusive_run

    started = time.monotonic()
    with exclusive_run("killed-run", wait_s=0):  # wait_s=0: only a reclaim can get it
        pass
    assert time.monotonic() - started < 5
