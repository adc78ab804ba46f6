"""Every flow as a deployment: one parameter model per flow, entry flows, and the set `rollflow worker` serves.

A deployment's parameter form is its entry function's signature. RunConfig has ~130 fields, most of them
unused by any one flow, so each flow gets a model of the RunConfig sections it reads (`TrainParams`,
`RolloutParams`, ...; built from RunConfig's own field definitions, so defaults, limits and descriptions
stay in one place) plus its own arguments. The entry flows carry the same names as the flows they run
(`rl_train`, `replay_train`, ...), call their plain bodies (no sub-flow run) and keep their options
(retries, hooks, run names), so the UI shows one flow per name whichever route started a run.

Two routes register the same five flows under distinct deployment names, so neither overwrites the other:
- `rollflow worker` serves `<flow>/worker` (and the nightly `alignment_check/nightly-alignment`) from one
  process (`prefect.serve`; keep it alive with infra/rollflow-worker.service);
- `prefect deploy --prefect-file infra/prefect.yaml --all` registers `<flow>/pool` (and
  `alignment_check/nightly-alignment-pool`) on a process work pool, run by `prefect worker start`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from prefect import Flow
from pydantic import BaseModel, ConfigDict, create_model

from rollflow.flows import alignment as _alignment
from rollflow.flows import bisect as _bisect
from rollflow.flows import debug as _debug
from rollflow.flows import train as _train
from rollflow.flows.config import RunConfig
from rollflow.tasks.checks import AlignmentThresholds

SERVED = "worker"  # deployment name of every flow served by `rollflow worker`
POOL = "pool"  # deployment name of every flow in infra/prefect.yaml (a process work pool)
NIGHTLY = _alignment.NIGHTLY
NIGHTLY_POOL = "nightly-alignment-pool"

_COMMON = ("run", "model", "store", "ray", "resources", "tracking")
SECTIONS: dict[str, tuple[str, ...]] = {
    # what each flow reads of RunConfig; the rest keeps RunConfig's defaults
    "rl_train": (*_COMMON, "iterations", "checkpoint_every", "eval_every", "resume", "data", "rollout", "algo",
                 "train", "placement", "offload", "debug", "pipeline"),  # retries: the deployment's own (UI Retry resumes)
    "rollout_only": (*_COMMON, "iterations", "eval_every", "data", "rollout"),
    "replay_train": (*_COMMON, "rollout", "algo", "train"),
    "alignment_check": (*_COMMON, "data", "rollout", "algo", "train"),
    "ima_bisect": ("run", "model", "store", "data", "rollout", "tracking"),
}


def _params_model(name: str, flow_name: str, doc: str) -> type[BaseModel]:
    fields = {key: (RunConfig.model_fields[key].annotation, RunConfig.model_fields[key])
              for key in SECTIONS[flow_name]}
    model = create_model(name, __config__=ConfigDict(extra="forbid"), **fields)  # type: ignore[call-overload]
    model.__doc__ = doc
    return model


TrainParams = _params_model("TrainParams", "rl_train", "RunConfig sections rl_train reads.")
RolloutParams = _params_model("RolloutParams", "rollout_only", "RunConfig sections rollout_only reads.")
ReplayParams = _params_model("ReplayParams", "replay_train", "RunConfig sections replay_train reads.")
AlignmentParams = _params_model("AlignmentParams", "alignment_check", "RunConfig sections alignment_check reads.")
BisectParams = _params_model("BisectParams", "ima_bisect", "RunConfig sections ima_bisect reads.")

PARAMS_MODELS: dict[str, type[BaseModel]] = {
    "rl_train": TrainParams, "rollout_only": RolloutParams, "replay_train": ReplayParams,
    "alignment_check": AlignmentParams, "ima_bisect": BisectParams,
}


def to_run_config(params: BaseModel, **debug: Any) -> RunConfig:
    """The full RunConfig of a flow's parameters (unlisted sections at their defaults), validated whole."""
    data = params.model_dump()
    if debug:
        data["debug"] = {**data.get("debug", {}), **{k: v for k, v in debug.items() if v is not None}}
    return RunConfig.model_validate(data)


def params_of(flow_name: str, cfg: RunConfig) -> dict[str, Any]:
    """A RunConfig as the JSON parameters of `flow_name`'s deployment (what `--submit` sends)."""
    model = PARAMS_MODELS[flow_name]
    return model.model_validate({k: getattr(cfg, k) for k in SECTIONS[flow_name]}).model_dump(mode="json")


def _like(original: Flow, fn: Callable[..., Any]) -> Flow:
    """An entry flow: `fn` under `original`'s name and options."""
    return Flow(
        fn=fn, name=original.name, description=original.description, flow_run_name=original.flow_run_name,
        retries=original.retries, retry_delay_seconds=original.retry_delay_seconds,
        timeout_seconds=original.timeout_seconds, on_failure=list(original.on_failure_hooks),
        on_crashed=list(original.on_crashed_hooks), on_cancellation=list(original.on_cancellation_hooks),
        on_completion=list(original.on_completion_hooks),
    )


def rl_train(params: TrainParams) -> dict:  # type: ignore[valid-type]
    return _train.rl_train.fn(to_run_config(params))


def rollout_only(params: RolloutParams, rollout_ids: Optional[list[int]] = None,  # type: ignore[valid-type]
                        checkpoint: Optional[int] = None, save_debug_rollout_data: Optional[str] = None) -> dict:
    cfg = to_run_config(params, rollout_only=True, save_debug_rollout_data=save_debug_rollout_data)
    return _debug.rollout_only.fn(cfg, rollout_ids=rollout_ids, checkpoint=checkpoint)


def replay_train(params: ReplayParams, rollout_ids: Optional[list[int]] = None,  # type: ignore[valid-type]
                        source_run: Optional[str] = None, load_debug_rollout_data: Optional[str] = None,
                        subsample: Optional[float] = None, dump_details: Optional[str] = None,
                        use_cache: bool = True) -> dict:
    cfg = to_run_config(params, train_only=True, load_debug_rollout_data=load_debug_rollout_data,
                        load_debug_rollout_data_subsample=subsample, dump_details=dump_details)
    return _debug.replay_train.fn(cfg, rollout_ids=rollout_ids, source_run=source_run, use_cache=use_cache)


def alignment_check(params: AlignmentParams, memory_budget_mb: Optional[float] = None,  # type: ignore[valid-type]
                     thresholds: Optional[AlignmentThresholds] = None) -> dict:
    return _alignment.alignment_check.fn(to_run_config(params), memory_budget_mb=memory_budget_mb,
                                     thresholds=thresholds)


def ima_bisect(params: BisectParams, crash_when: Optional[str] = None,  # type: ignore[valid-type]
                  timeout_s: float = 300, coredump: bool = True, fault: Optional[str] = None, parallel: int = 1,
                  rollout_id: int = 0) -> dict:
    return _bisect.ima_bisect.fn(to_run_config(params), crash_when=crash_when, timeout_s=timeout_s,
                                coredump=coredump, fault=fault, parallel=parallel, rollout_id=rollout_id)


# The deployable flows (entrypoints `rollflow.flows.deployments:<name>` in infra/prefect.yaml): each name is
# first the plain entry function above, then the Flow wrapping it, so an entrypoint loads the Flow itself
# (with its run names, retries and hooks), never a bare function Prefect would wrap anew.
rl_train = _like(_train.rl_train, rl_train)
rollout_only = _like(_debug.rollout_only, rollout_only)
replay_train = _like(_debug.replay_train, replay_train)
alignment_check = _like(_alignment.alignment_check, alignment_check)
ima_bisect = _like(_bisect.ima_bisect, ima_bisect)


def entry_flows() -> dict[str, Flow]:
    return {"rl_train": rl_train, "rollout_only": rollout_only, "replay_train": replay_train,
            "alignment_check": alignment_check, "ima_bisect": ima_bisect}


def default_parameters(flow_name: str, run: str | None = None) -> dict[str, Any]:
    """Defaults that run on the embedded default (CPU, built-in model, local artifacts)."""
    base = RunConfig(run=run or flow_name.replace("_", "-"))
    return {"params": params_of(flow_name, base)}


def deployment_name(flow_name: str, route: str = SERVED) -> str:
    return f"{flow_name}/{route}"


def served_deployments(nightly_cron: str | None = "0 2 * * *", nightly_cfg: RunConfig | None = None,
                       memory_budget_mb: float | None = None) -> list:
    """RunnerDeployments of all five flows (`<flow>/worker`), plus the scheduled nightly alignment check."""
    from prefect.deployments.runner import EntrypointType

    flows = entry_flows()
    out = []
    for name, entry in flows.items():
        out.append(entry.to_deployment(
            name=SERVED, entrypoint_type=EntrypointType.MODULE_PATH, parameters=default_parameters(name),
            tags=["rollflow", name],
            description=f"{entry.description or name} (served by `rollflow worker`)"))
    if nightly_cron:
        out.append(_alignment.nightly_deployment(nightly_cron, nightly_cfg, memory_budget_mb=memory_budget_mb))
    return out
