"""Debug side outputs of a committed rollout: slime `.pt` export and `--dump-details` copies."""

from __future__ import annotations

from artifacts.store import ArtifactRef, RolloutStore
from flows.config import RunConfig


def dump_uri(cfg: RunConfig, rollout_id: int) -> str | None:
    if not cfg.debug.dump_details:
        return None
    return f"{cfg.debug.dump_details.rstrip('/')}/{cfg.run}/train_dumps/{rollout_id:06d}.parquet"


def side_exports(cfg: RunConfig, ref: dict) -> None:
    """slime `.pt` export and the `--dump-details` copy of a committed rollout artifact."""
    if not (cfg.debug.save_debug_rollout_data or cfg.debug.dump_details):
        return
    art_ref = ArtifactRef.from_dict(ref)
    artifact = RolloutStore(cfg.store.root).load_uri(art_ref.uri)
    if cfg.debug.save_debug_rollout_data:
        from artifacts.slime import export_slime_pt, expand_template

        target = expand_template(cfg.debug.save_debug_rollout_data, art_ref.rollout_id, art_ref.split)
        export_slime_pt(artifact.samples, art_ref.rollout_id, target, split=art_ref.split)
    if cfg.debug.dump_details:
        dump = RolloutStore(cfg.debug.dump_details)
        if not dump.exists(cfg.run, art_ref.split, art_ref.rollout_id):
            m = artifact.manifest
            dump.write(cfg.run, art_ref.split, art_ref.rollout_id, artifact.samples,
                       n_samples_per_prompt=m.n_samples_per_prompt, engine=m.engine, config_hash=m.config_hash,
                       extra=m.extra)
