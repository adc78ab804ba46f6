"""The five flows as `<flow>/pool` deployments on the test cluster's process work pool (infra/cluster.py runs
`python -m rollflow.flows.cluster_pool STATE_DIR` against the cluster's Prefect API): the pool, the S3 result
block and deployments whose default parameters point at the cluster's S3 store and Ray head; plus the nightly
alignment deployment on the same pool with its Failed/Crashed/Late alert automation."""

from __future__ import annotations

import sys

from rollflow.flows.alignment import nightly_deployment
from rollflow.flows.config import RunConfig
from rollflow.flows.prefect_ops.deployments import POOL as DEPLOYMENT
from rollflow.flows.prefect_ops.deployments import default_parameters, entry_flows
from rollflow.infra.automations import apply_with_alert
from rollflow.infra.cluster import POOL as CLUSTER_POOL
from rollflow.infra.cluster import RESULTS_BLOCK, Cluster


def register_deployments(cl: Cluster) -> None:
    """(In a process whose PREFECT_API_URL is the cluster's.) The work pool (what `prefect work-pool create
    rollflow-cluster --type process` makes), the result block and the pool deployments."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        client.create_work_pool(
            WorkPoolCreate(
                name=CLUSTER_POOL, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
            )
        )
    from prefect.deployments.runner import EntrypointType
    from prefect.filesystems import RemoteFileSystem

    RemoteFileSystem(basepath=cl.results_root, settings={"client_kwargs": {"endpoint_url": cl.s3_endpoint}}).save(
        RESULTS_BLOCK.split("/", 1)[1], overwrite=True
    )
    for name, entry in entry_flows().items():
        params = default_parameters(name)
        inner = params.get("params", params)
        for key, value in cl.run_params().items():
            if key in inner:
                inner[key] = {**inner[key], **value} if isinstance(inner[key], dict) else value
        entry.to_deployment(
            name=DEPLOYMENT,
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=params,
            work_pool_name=CLUSTER_POOL,
            tags=["rollflow", name],
        ).apply(work_pool_name=CLUSTER_POOL)
    register_nightly_on_pool(cl)


def register_nightly_on_pool(cl: Cluster) -> None:
    """`alignment_check/nightly-alignment` on the pool (what `prefect deploy` of infra/prefect.yaml's nightly entry
    makes), pointing at the cluster, and its alert automation."""
    cfg = RunConfig.model_validate({"run": "nightly", **cl.run_params()})
    deployment = nightly_deployment(cfg=cfg)
    deployment.work_pool_name = CLUSTER_POOL
    # The test cluster keeps the cron schedule but not active: a CI run at 02:00 UTC would otherwise get a
    # scheduled nightly run in the middle of its drills. A real pool keeps it active.
    for schedule in deployment.schedules:
        schedule.active = False
    apply_with_alert(deployment)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    register_deployments(Cluster.load(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
