"""Debug side outputs of a committed rollout: slime `.pt` export and `--dump-details` copies."""

from __future__ import annotations

from rollflow.artifacts.slime import expand_template, export_slime_pt
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.flows.config import RunConfig


def dump_uri(cfg: RunConfig, rollout_id: int) -> str | None:
    """Where the per-token train dump of a rollout goes (next to the copied rollouts, so `show` finds it)."""
    if not cfg.debug.dump_details:
        return None
    return f"{cfg.debug.dump_details.rstrip('/')}/{cfg.run}/train_dumps/{rollout_id:06d}.parquet"


def copy_to_dump(cfg: RunConfig, store: RolloutStore, art_ref: ArtifactRef) -> None:
    """`--dump-details DIR`: DIR is a store root holding this run's rollouts and train dumps."""
    if not cfg.debug.dump_details:
        return
    dump = RolloutStore(cfg.debug.dump_details)
    if dump.exists(cfg.run, art_ref.split, art_ref.rollout_id):
        return
    artifact = store.load_uri(art_ref.uri)
    m = artifact.manifest
    dump.write(
        cfg.run,
        art_ref.split,
        art_ref.rollout_id,
        artifact.samples,
        n_samples_per_prompt=m.n_samples_per_prompt,
        engine=m.engine,
        config_hash=m.config_hash,
        extra=m.extra,
    )


def export_slime(cfg: RunConfig, store: RolloutStore, art_ref: ArtifactRef) -> None:
    """`--save-debug-rollout-data T`: every committed rollout is also written in slime's `.pt` format."""
    if not cfg.debug.save_debug_rollout_data:
        return
    artifact = store.load_uri(art_ref.uri)
    target = expand_template(cfg.debug.save_debug_rollout_data, art_ref.rollout_id, art_ref.split)
    export_slime_pt(artifact.samples, art_ref.rollout_id, target, split=art_ref.split)


def side_exports(cfg: RunConfig, store: RolloutStore, ref: ArtifactRef) -> None:
    export_slime(cfg, store, ref)
    copy_to_dump(cfg, store, ref)
