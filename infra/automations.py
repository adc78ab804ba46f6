"""Prefect automations rollflow relies on, created idempotently (by name) through Prefect's Python API.

- `ensure_crash_detection()`: a rollflow flow run that stops sending heartbeats (its process was
  SIGKILLed, the machine died) becomes `Crashed` without anyone acting. Every rollflow flow body emits
  `rollflow.flow-run.heartbeat` every `HEARTBEAT_S` (flows/prefect_ops/heartbeats.py); a proactive
  trigger expects, within `CRASH_AFTER_S` of each, another one or a terminal event of the same flow run,
  and otherwise changes the run's state to Crashed. This is Prefect's "zombie flow" mechanism (docs:
  detect-zombie-flows) on rollflow's own event rather than Prefect's `prefect.flow-run.heartbeat`: the
  automation lives on a server other teams share, and their flows beat at whatever interval they chose
  (Prefect 3.9 defaults to 180 s), so an automation on Prefect's event would mark their healthy runs
  Crashed. Only runs that sent a rollflow beat are ever judged.
- `ensure_deployment_alert(deployment_id)`: fires on a Failed, Crashed or Late run of one deployment
  (the nightly alignment check). Its action sends a notification when a notification block is named
  (`ROLLFLOW_ALERT_BLOCK`, any Prefect notification block, e.g. a Slack webhook), else does nothing:
  the automation's firing is still an event (`prefect.automation.triggered`) visible in the UI's
  event feed and through the API.

Both functions talk to the current `PREFECT_API_URL`; a server without the events/automations
services (the ephemeral API) still accepts the definitions.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional
from uuid import UUID

HEARTBEAT_S = 30  # Prefect's minimum heartbeat interval (flow_engine.MINIMUM_HEARTBEAT_INTERVAL)
CRASH_AFTER_S = 90  # no heartbeat (nor terminal event) for this long after one: the run is Crashed
CRASH_AUTOMATION = "rollflow: crash flow runs without heartbeat"
ALERT_PREFIX = "rollflow: alert on failed, crashed or late runs of"
HEARTBEAT_EVENT = "rollflow.flow-run.heartbeat"  # sent by rollflow flow bodies only (see the module docstring)
TERMINAL_EVENTS = ("Completed", "Failed", "Cancelled", "Crashed")
ALERT_EVENTS = ("Failed", "Crashed", "Late")
ALERT_BLOCK_ENV = "ROLLFLOW_ALERT_BLOCK"  # "<block-type-slug>/<block-name>" of a notification block


def heartbeat_env(seconds: int = HEARTBEAT_S) -> dict[str, str]:
    """Environment that makes flow runs of a (child) process send heartbeats every `seconds`."""
    return {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(max(30, int(seconds)))}


def enable_heartbeats(seconds: int = HEARTBEAT_S) -> None:
    """Heartbeats for flow runs started by this process. Prefect reads the setting from the
    environment when its settings context is built (at `import prefect`), so set it before that, or
    run flows inside `heartbeat_settings()`. An explicit user setting wins."""
    for key, value in heartbeat_env(seconds).items():
        os.environ.setdefault(key, value)


def heartbeat_settings(seconds: int | None = None):
    """A settings context (`with heartbeat_settings(): flow(...)`) with heartbeats every `seconds`
    (default: the environment's value, else `HEARTBEAT_S`); works after `import prefect`."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    if seconds is None:
        seconds = int(os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") or HEARTBEAT_S)
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: max(30, int(seconds))})


def _upsert(automation: Any) -> UUID:
    """Create the automation, or update the one with its name to this definition; returns its id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation.name)
        if not existing:
            return client.create_automation(automation)
        keep, *duplicates = sorted(existing, key=lambda a: str(a.id))
        client.update_automation(keep.id, automation)
        for dup in duplicates:  # two processes raced on the first create: keep one
            client.delete_automation(dup.id)
        return keep.id


def crash_detection_automation(crash_after_s: float = CRASH_AFTER_S):
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=CRASH_AUTOMATION,
        description=(
            f"Marks a rollflow flow run Crashed when {crash_after_s:.0f} s pass after one of its "
            f"{HEARTBEAT_EVENT} events without another one or a terminal state (its process was killed). "
            f"Created by rollflow; its flow bodies send that event every {HEARTBEAT_S} s. Other flows on "
            "this server are never matched."
        ),
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={HEARTBEAT_EVENT},
            expect={HEARTBEAT_EVENT, *(f"prefect.flow-run.{s}" for s in TERMINAL_EVENTS)},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=crash_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                name="Crashed",
                message=f"No heartbeat for {crash_after_s:.0f} s: the flow run's process is gone "
                "(marked by the rollflow crash-detection automation)",
            )
        ],
    )


def ensure_crash_detection(crash_after_s: float = CRASH_AFTER_S) -> UUID:
    """Create (or update) the crash-detection automation on the current API; returns its id."""
    return _upsert(crash_detection_automation(crash_after_s))


def _notification_action(subject: str, body: str) -> Optional[Any]:
    """A SendNotification action on the block named by ROLLFLOW_ALERT_BLOCK, if one is configured."""
    spec = os.environ.get(ALERT_BLOCK_ENV)
    if not spec:
        return None
    from prefect.blocks.core import Block
    from prefect.events.actions import SendNotification

    block = Block.load(spec)  # "slack-webhook/ops" etc.; a wrong name fails the deploy step loudly
    return SendNotification(block_document_id=block._block_document_id, subject=subject, body=body)


def alert_name(label: str) -> str:
    return f"{ALERT_PREFIX} {label}"


def deployment_alert_automation(deployment_id: UUID | str, label: str):
    from prefect.events.actions import DoNothing
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    subject = f"rollflow: {label} run {{{{ flow_run.name }}}} is {{{{ flow_run.state.name }}}}"
    body = (
        "Flow run {{ flow_run.name }} of deployment {{ deployment.name }} ended "
        "{{ flow_run.state.name }}: {{ flow_run.state.message }}\n{{ flow_run|ui_url }}"
    )
    action = _notification_action(subject, body) or DoNothing()
    return AutomationCore(
        name=alert_name(label),
        description=(
            f"Fires when a run of {label} (deployment {deployment_id}) is Failed, Crashed or Late. "
            f"Notifies through the block in {ALERT_BLOCK_ENV} when set; the firing is an event "
            "(prefect.automation.triggered) either way. Created by rollflow's deploy step."
        ),
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect={f"prefect.flow-run.{s}" for s in ALERT_EVENTS},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "deployment",
                "prefect.resource.id": f"prefect.deployment.{deployment_id}",
            },
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(0),
        ),
        actions=[action],
    )


def ensure_deployment_alert(deployment_id: UUID | str, label: str) -> UUID:
    """Create (or update) the alert automation of one deployment; `label` names it (e.g.
    "alignment_check/nightly-alignment"). Returns the automation's id."""
    return _upsert(deployment_alert_automation(deployment_id, label))


def automation_events(automation_id: UUID | str, since_s: float = 3600, limit: int = 50) -> list[dict]:
    """Events about an automation (`prefect.automation.triggered`, `...action.executed`), newest first."""
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client

    now = datetime.now(timezone.utc)
    body = {
        "filter": {
            "occurred": {
                "since": (now - timedelta(seconds=since_s)).isoformat(),
                "until": (now + timedelta(seconds=60)).isoformat(),
            },
            "any_resource": {"id": [f"prefect.automation.{automation_id}"]},
            "order": "DESC",
        },
        "limit": limit,
    }
    with get_client(sync_client=True) as client:
        response = client.request("POST", "/events/filter", json=body)
        return list(response.json().get("events", []))


_prepared: set[str] = set()


def prepare_flow_runs(api: str) -> str:
    """What a process that starts flow runs against `api` does first (the rollflow CLI, `rollflow serve`):
    heartbeats on for its flow runs and the crash-detection automation present (once per process and
    API; best effort: a server that refuses only costs the automatic Crashed state). Returns `api`."""
    import logging

    enable_heartbeats()
    if api in _prepared:
        return api
    _prepared.add(api)
    # the automation judges rollflow's own heartbeat event, sent by every rollflow flow body
    # (flows/prefect_ops/heartbeats.py) whatever Prefect's heartbeat setting in this process is
    try:
        ensure_crash_detection()
    except Exception as exc:  # noqa: BLE001 - the run itself must not fail for this
        logging.getLogger("rollflow.automations").warning(
            f"could not create the crash-detection automation on {api}: {exc}"
        )
    return api


def apply_with_alert(deployment: Any, label: str | None = None) -> tuple[UUID, UUID]:
    """Apply (create or update) a RunnerDeployment and ensure its Failed/Crashed/Late alert automation;
    returns (deployment id, automation id). The deploy step of scheduled deployments uses this."""
    deployment_id = deployment.apply()
    label = label or f"{deployment.flow_name}/{deployment.name}"
    return deployment_id, ensure_deployment_alert(deployment_id, label)
