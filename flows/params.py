"""The parameter model of each deployable flow: the RunConfig sections it reads, as its own signature's form.

RunConfig has ~130 fields, most of them unused by any one flow, so each deployable flow takes a model of the
RunConfig sections it reads (`TrainParams`, `RolloutParams`, ...; built from RunConfig's own field
definitions, so defaults, limits and descriptions stay in one place) plus its own arguments. The Prefect UI
renders that signature as the flow's form, whichever route (UI, schedule, `--submit`, a local call) starts it.

A flow accepts either form of its first argument:
- its section model, or a dict of it (UI, API, deployments): the sections over RunConfig's defaults;
- a whole RunConfig (in-process callers: the CLI, tests): kept whole, so fields outside the sections
  (`retries`, `timeout_s`: the local route's flow-run settings) keep their values. `params.run_config()`
  gives the flow its RunConfig.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, PrivateAttr, create_model, model_validator

from rollflow.flows.config import RunConfig

_COMMON = ("run", "model", "store", "ray", "resources", "tracking")
SECTIONS: dict[str, tuple[str, ...]] = {
    # what each flow reads of RunConfig; the rest keeps RunConfig's defaults
    "rl_train": (
        *_COMMON,
        "iterations",
        "checkpoint_every",
        "eval_every",
        "resume",
        "resume_from",
        "data",
        "rollout",
        "algo",
        "train",
        "placement",
        "offload",
        "debug",
        "pipeline",
        "watchdog",
    ),  # retries, timeout_s: flow-run settings, not parameters (flows/prefect_ops/submit.py)
    # pipeline: dynamic sampling; watchdog: the stall deadline of generate; algo: routing_replay records each
    # sample's experts for a later replay (and the config's checks read the algorithm the rollouts are for)
    "rollout_only": (*_COMMON, "iterations", "eval_every", "data", "rollout", "algo", "pipeline", "watchdog"),
    "replay_train": (*_COMMON, "rollout", "algo", "train"),
    # iterations: the length of the reproducibility gate's and the kill-and-resume drill's runs
    "alignment_check": (
        *_COMMON,
        "iterations",
        "data",
        "rollout",
        "algo",
        "train",
        # what the check's workers are built from, as the run's own (colocated, offloaded, pipelined, drills)
        "placement",
        "offload",
        "pipeline",
        "debug",
    ),
    "ima_bisect": ("run", "model", "store", "data", "rollout", "train", "tracking"),
}


class FlowParams(BaseModel):
    """Base of the section models: validates from its sections or from a whole RunConfig (kept whole)."""

    model_config = ConfigDict(extra="forbid")
    _config: Optional[RunConfig] = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _from_run_config(cls, data: Any, handler: Any) -> "FlowParams":
        if not isinstance(data, RunConfig):
            return handler(data)
        params = handler({key: getattr(data, key) for key in cls.model_fields})
        params._config = data
        return params

    def run_config(self, mode: Optional[str] = None, **debug: Any) -> RunConfig:
        """The RunConfig the flow runs. From a RunConfig: that one (with any non-None `debug` fields set). From
        the sections: RunConfig's defaults elsewhere, debug.`mode` switched on and the non-None `debug` fields
        set (the deployment's own arguments)."""
        if self._config is None:
            return to_run_config(self, **({mode: True} if mode else {}), **debug)
        extra = {k: v for k, v in debug.items() if v is not None}
        if not extra:
            return self._config
        data = self._config.model_dump()
        data["debug"] = {**data["debug"], **extra}
        return RunConfig.model_validate(data)


def _params_model(name: str, flow_name: str, doc: str) -> type[FlowParams]:
    fields = {key: (RunConfig.model_fields[key].annotation, RunConfig.model_fields[key]) for key in SECTIONS[flow_name]}
    model = create_model(name, __base__=FlowParams, **fields)  # type: ignore[call-overload]
    model.__doc__ = doc
    return model


TrainParams = _params_model("TrainParams", "rl_train", "RunConfig sections rl_train reads.")
RolloutParams = _params_model("RolloutParams", "rollout_only", "RunConfig sections rollout_only reads.")
ReplayParams = _params_model("ReplayParams", "replay_train", "RunConfig sections replay_train reads.")
AlignmentParams = _params_model("AlignmentParams", "alignment_check", "RunConfig sections alignment_check reads.")
BisectParams = _params_model("BisectParams", "ima_bisect", "RunConfig sections ima_bisect reads.")

PARAMS_MODELS: dict[str, type[FlowParams]] = {
    "rl_train": TrainParams,
    "rollout_only": RolloutParams,
    "replay_train": ReplayParams,
    "alignment_check": AlignmentParams,
    "ima_bisect": BisectParams,
}


def to_run_config(params: BaseModel, **debug: Any) -> RunConfig:
    """The full RunConfig of a flow's sections (unlisted sections at their defaults), validated whole."""
    data = params.model_dump()
    if debug:
        data["debug"] = {**data.get("debug", {}), **{k: v for k, v in debug.items() if v is not None}}
    return RunConfig.model_validate(data)


def params_of(flow_name: str, cfg: RunConfig) -> dict[str, Any]:
    """A RunConfig as the JSON of `flow_name`'s section model (what `--submit` and deployments send)."""
    return PARAMS_MODELS[flow_name].model_validate(cfg).model_dump(mode="json")
