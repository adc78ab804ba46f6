"""Prefect operations around the flows: deployments (what `rollflow worker` serves), submitting a run through
its deployment, one active run per run name (run_lock), UI cancellation and actor cleanup, flow-run names and
tags, and the storage retry policy of tasks."""
