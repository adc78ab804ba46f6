"""The post-sync probe, driven from the sync task (docs/checks.md, tasks/sync/probe.py): the engine generates the
probe sequences, the trainer scores the same tokens, and the mean |delta log-prob| must stay under the bound of
the run's dtypes. Weight checksums say the engine holds the right tensors; this says it serves them."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup
from rollflow.flows.stall_watch import watched
from rollflow.infra.clients import EngineClient, TrainerClient
from rollflow.tasks.sync.probe import ProbeBounds, ProbeReport, ProbeSpec, compare_probe


def probe_due(cfg: RunConfig, weight_version: int) -> bool:
    """Every `watchdog.probe_every`-th sync (by weight version, so a resume keeps the cadence); 0 = never."""
    every = cfg.watchdog.probe_every
    return every > 0 and weight_version % every == 0


def served_dtype(cfg: RunConfig) -> str:
    """The dtype the engine computes in (SGLang's own setting, else rollout.dtype)."""
    return (cfg.rollout.sglang.dtype if cfg.rollout.engine == "sglang" else None) or cfg.rollout.dtype


def probe_bound(cfg: RunConfig) -> tuple[str, float]:
    wd = cfg.watchdog
    bounds = ProbeBounds(float32=wd.probe_max_diff_fp32, bfloat16=wd.probe_max_diff_bf16)
    return bounds.for_dtypes(cfg.train.dtype, served_dtype(cfg))


def run_probe(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> ProbeReport:
    """Score the probe on both sides; the report says whether it passed (the caller fails the task)."""
    spec = ProbeSpec(prompts=cfg.watchdog.probe_prompts, tokens=cfg.watchdog.probe_tokens)
    samples = engine.probe(spec)
    trainer_lp = trainer.score_probe(samples)
    dtype, bound = probe_bound(cfg)
    return compare_probe(
        [s.rollout_log_probs for s in samples], trainer_lp, dtype=dtype, bound=bound, weight_version=weight_version
    )


@task(name="sync-probe", cache_policy=NO_CACHE)
@watched("sync-probe")
def probe_task(cfg: RunConfig, weight_version: int) -> float:
    """The probe as its own task (green or red in the UI); returns `sync/probe_logprob_diff`."""
    group = WorkerGroup.for_run(cfg)
    probe = run_probe(cfg, group.trainer(), group.engine(), weight_version)
    if not probe.ok:
        raise ProbeFailed(probe.summary())
    return probe.mean_abs_diff


class ProbeFailed(RuntimeError):
    """The engine serves other weights than the checksums say it holds (the message is the probe's one line)."""
