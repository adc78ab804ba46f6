"""One active flow run per rollflow run name: a second one fails at once with a message, and does not touch
the first one's actors or artifacts (a real Prefect API; the limit is Prefect's global concurrency limit)."""

from __future__ import annotations

import pytest


def test_second_run_of_a_name_is_refused_while_the_first_holds_it(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    from rollflow.flows.config import RunConfig
    from rollflow.flows.debug import rollout_only
    from rollflow.flows.run_lock import RunBusy, exclusive_run, limit_name

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
