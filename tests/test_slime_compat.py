"""slime `.pt` debug dumps: lossless import/export, templates, and refusal of code-carrying pickles."""

from __future__ import annotations

import copy
import os
import pickle
import uuid

import pytest
import torch
import typer
from typer.testing import CliRunner

from rollflow.artifacts import ArtifactSchemaError, EngineInfo, RolloutStore, Sample, Status
from rollflow.artifacts.slime import (
    SlimeTemplateError,
    discover_template_ids,
    expand_template,
    export_slime_pt,
    import_slime_pt,
    sample_to_slime_dict,
)
from rollflow.flows.cli.tools import register
from rollflow.tasks.debug.display import discover

ENGINE = EngineInfo(backend="hf", model="tiny", weight_version=2)


def cli():
    app = typer.Typer()
    register(app)
    return app


def rollflow_samples() -> list[Sample]:
    samples = []
    for k in range(4):
        samples.append(
            Sample(
                group_index=k // 2,
                index=k,
                prompt="012+345=" if k % 2 == 0 else [{"role": "user", "content": "1+1=?"}],
                tokens=[1, 3, 4, 5] + [6 + k, 7, 2],
                response=f"03{k}7",
                response_length=3,
                loss_mask=[1, 1, 0],
                rollout_log_probs=[-0.25, -0.0, -1e-300 * k],
                reward={"acc": 1.0, "fmt": 0.5} if k == 3 else float(k) / 2,
                label="0357",
                status=Status.parse(["completed", "Status.TRUNCATED", "aborted", "failed"][k]),
                weight_version=2,
                reward_key="acc" if k == 3 else None,
                metadata={
                    "source": "unit",
                    "nested": {"a": [1, None]},
                    "extra_fields": {"spec_info": {"accept": k}, "train_metadata": None},
                },
            )
        )
    return samples


def slime_dict(k: int, **overrides) -> dict:
    """A sample dict as slime's Sample.to_dict() writes it (fields rollflow does not model included)."""
    d = {
        "group_index": k // 2,
        "index": k,
        "prompt": "012+345=",
        "tokens": [1, 3, 4, 5, 6, 7, 2],
        "multimodal_inputs": None,
        "response": "0357",
        "response_length": 3,
        "label": "0357",
        "reward": 1.0,
        "loss_mask": [1, 1, 1],
        "weight_versions": ["4"],
        "rollout_log_probs": [-0.5, -0.25, -0.125],
        "rollout_routed_experts": None,
        "remove_sample": False,
        "status": "Status.TRUNCATED" if k == 1 else "completed",
        "metadata": {"dataset": "gsm8k"},
        "train_metadata": {"epoch": 1},
        "non_generation_time": 0.01,
        "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0},
        "prefix_cache_info": {"cached_tokens": 3, "total_prompt_tokens": 4},
        "my_custom_field": [k, "x"],
    }
    d.update(overrides)
    return d


# ----------------------------------------------------------------------------- round trips


def test_export_import_round_trip_equal_samples(tmp_path):
    samples = rollflow_samples()
    written = export_slime_pt(samples, 7, str(tmp_path / "dump" / "rollout_{rollout_id}.pt"))
    assert written.endswith("rollout_7.pt") and os.path.exists(written)
    rid, back = import_slime_pt(written)
    assert rid == 7
    assert back == samples
    assert back[1].status is Status.TRUNCATED
    assert back[0].metadata["extra_fields"] == {"spec_info": {"accept": 0}, "train_metadata": None}

    # The file is slime's shape with plain types only: extra fields at top level, statuses as values.
    raw = torch.load(written, weights_only=True)
    assert raw["rollout_id"] == 7 and len(raw["samples"]) == 4
    first = raw["samples"][0]
    assert first["spec_info"] == {"accept": 0} and "extra_fields" not in first["metadata"]
    assert first["status"] == "completed" and raw["samples"][1]["status"] == "truncated"
    assert first["weight_versions"] == ["2"]

    def plain(value):
        assert not isinstance(value, torch.Tensor)
        if isinstance(value, dict):
            for v in value.values():
                plain(v)
        elif isinstance(value, list):
            for v in value:
                plain(v)
        else:
            assert value is None or isinstance(value, (str, int, float, bool))

    plain(raw)


def test_slime_dict_with_extra_fields_survives_store_and_export(tmp_path):
    original = {"rollout_id": 3, "samples": [slime_dict(0), slime_dict(1)]}
    path = tmp_path / "data_3.pt"
    torch.save(copy.deepcopy(original), path)

    rid, samples = import_slime_pt(str(path))
    assert rid == 3
    assert [s.status for s in samples] == [Status.COMPLETED, Status.TRUNCATED]
    assert samples[0].weight_version == 4
    assert samples[0].metadata["dataset"] == "gsm8k"
    extra = samples[0].metadata["extra_fields"]
    assert extra["my_custom_field"] == [0, "x"] and extra["prefix_cache_info"]["cached_tokens"] == 3
    assert "rollout_log_probs_missing" not in samples[0].metadata

    # Through a committed artifact (parquet) and back out to slime's format: nothing lost.
    store = RolloutStore(str(tmp_path / "store"))
    store.write("imported", "train", rid, samples, n_samples_per_prompt=2, engine=ENGINE, config_hash="x")
    loaded = store.load("imported", "train", rid).samples
    assert loaded == samples
    out = export_slime_pt(loaded, rid, str(tmp_path / "again_{rollout_id}.pt"))
    again = torch.load(out, weights_only=True)
    for before, after in zip(original["samples"], again["samples"]):
        expected = dict(before, status="truncated" if before["status"] == "Status.TRUNCATED" else "completed")
        assert {k: after[k] for k in expected} == expected
        assert after["weight_version"] == 4 and after["reward_key"] is None


def test_missing_log_probs_and_loss_mask_are_filled_and_flagged(tmp_path):
    raw = slime_dict(
        0, rollout_log_probs=None, loss_mask=None, status="pending", label={"answer": 357}, weight_versions=[]
    )
    path = tmp_path / "data_0.pt"
    torch.save({"rollout_id": 0, "samples": [raw]}, path)
    _, [sample] = import_slime_pt(str(path))
    assert sample.rollout_log_probs == [0.0, 0.0, 0.0] and sample.loss_mask == [1, 1, 1]
    assert sample.metadata["rollout_log_probs_missing"] is True
    assert sample.metadata["loss_mask_missing"] is True
    assert sample.status is Status.ABORTED and sample.metadata["slime_status"] == "pending"
    assert sample.weight_version == 0
    sample.validate()
    back = sample_to_slime_dict(sample)
    assert back["rollout_log_probs"] is None and back["loss_mask"] is None
    assert back["status"] == "pending" and back["label"] == {"answer": 357} and back["weight_versions"] == []
    assert "rollout_log_probs_missing" not in back["metadata"]


def test_tensor_fields_load_as_lists(tmp_path):
    raw = slime_dict(
        0,
        rollout_log_probs=torch.tensor([-0.5, -0.25, -0.125], dtype=torch.float64),
        tokens=torch.tensor([1, 3, 4, 5, 6, 7, 2]),
    )
    path = tmp_path / "data_0.pt"
    torch.save({"rollout_id": 0, "samples": [raw]}, path)
    _, [sample] = import_slime_pt(str(path))
    assert sample.rollout_log_probs == [-0.5, -0.25, -0.125] and sample.tokens == [1, 3, 4, 5, 6, 7, 2]


def test_fsspec_memory_template_round_trip():
    base = f"memory://slime-{uuid.uuid4().hex}"
    template = base + "/dumps/data_{rollout_id}.pt"
    samples = rollflow_samples()
    export_slime_pt(samples, 1, template)
    export_slime_pt(samples, 4, template)
    export_slime_pt(samples[:2], 0, template, split="eval")
    assert discover_template_ids(template) == {"train": [1, 4], "eval": [0]}
    assert import_slime_pt(base + "/dumps/data_eval_0.pt")[1] == samples[:2]
    found = discover(template)
    assert [(f.split, f.rollout_id) for f in found] == [("train", 1), ("train", 4), ("eval", 0)]
    assert found[1].loader() == samples


# ----------------------------------------------------------------------------- templates


def test_template_expansion_and_errors(tmp_path):
    assert expand_template("d/data_{rollout_id}.pt", 5) == "d/data_5.pt"
    assert expand_template("d/data_{rollout_id}.pt", 5, "eval") == "d/data_eval_5.pt"
    assert expand_template("d/{rollout_id:04d}/x_{rollout_id:04d}.pt", 5, "eval") == "d/eval_0005/x_eval_0005.pt"
    with pytest.raises(SlimeTemplateError, match=r"template 'd/data\.pt' has no \{rollout_id\}"):
        expand_template("d/data.pt", 1)
    with pytest.raises(SlimeTemplateError, match="has no {rollout_id}"):
        discover_template_ids(str(tmp_path / "data.pt"))
    with pytest.raises(SlimeTemplateError, match=r"unknown placeholder \{step\}"):
        expand_template("d/{step}_{rollout_id}.pt", 1)
    with pytest.raises(SlimeTemplateError, match="has no {rollout_id}"):
        expand_template("x.pt", 0, "eval")
    # A concrete path (no placeholder) is written as is.
    assert export_slime_pt([], 0, str(tmp_path / "x.pt"), split="eval") == str(tmp_path / "x.pt")


def test_discover_ids_in_padded_template(tmp_path):
    template = str(tmp_path / "r" / "{rollout_id:03d}.pt")
    for rid in (0, 2, 11):
        export_slime_pt(rollflow_samples()[:1], rid, template)
    export_slime_pt(rollflow_samples()[:1], 2, template, split="eval")
    (tmp_path / "r" / "notes.pt").write_bytes(b"")
    assert discover_template_ids(template) == {"train": [0, 2, 11], "eval": [2]}


def test_cli_export_then_import_slime(tmp_path):
    store = RolloutStore(str(tmp_path / "store"))
    samples = rollflow_samples()
    for rid in (0, 1):
        store.write("src", "train", rid, samples, n_samples_per_prompt=2, engine=ENGINE, config_hash="c")
    template = str(tmp_path / "dumps" / "data_{rollout_id}.pt")
    runner = CliRunner()
    res = runner.invoke(cli(), ["export-slime", str(tmp_path / "store" / "src"), template, "--all"])
    assert res.exit_code == 0, res.output
    assert discover_template_ids(template) == {"train": [0, 1], "eval": []}

    res = runner.invoke(cli(), ["export-slime", str(tmp_path / "store" / "src"), str(tmp_path / "one.pt"), "--all"])
    assert res.exit_code == 2 and "has no {rollout_id}" in res.output

    res = runner.invoke(cli(), ["import-slime", template, "--root", str(tmp_path / "store"), "--run", "dst", "--all"])
    assert res.exit_code == 0, res.output
    assert store.list_ids("dst", "train") == [0, 1]
    assert store.load("dst", "train", 1).samples == samples
    manifest = store.manifest("dst", "train", 1)
    assert manifest.engine.backend == "slime" and manifest.n_samples_per_prompt == 2


# ----------------------------------------------------------------------------- refusing code


class _WritesMarker:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        # Unpickling this would call open(marker, "w"): creating the file proves code ran.
        return (open, (self.marker, "w"))


class _RunsShell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("flavour", ["torch_save_zip", "raw_pickle"])
def test_malicious_pt_is_refused_and_runs_no_code(tmp_path, flavour):
    marker = tmp_path / "PWNED"
    path = tmp_path / "data_0.pt"
    if flavour == "torch_save_zip":
        torch.save({"rollout_id": 0, "samples": [_WritesMarker(str(marker))]}, path)
    else:
        with open(path, "wb") as fh:
            pickle.dump({"rollout_id": 0, "samples": [_RunsShell(str(marker))]}, fh, protocol=2)
    with pytest.raises(ArtifactSchemaError) as info:
        import_slime_pt(str(path))
    message = str(info.value)
    assert "refuses to unpickle arbitrary objects" in message
    assert "only reads plain-data .pt" in message
    assert not marker.exists()

    # The CLI says the same and exits 2, still without running anything.
    res = CliRunner().invoke(cli(), ["show", str(tmp_path / "data_{rollout_id}.pt")])
    assert res.exit_code == 2
    assert "refuses to unpickle arbitrary objects" in res.output
    assert not marker.exists()


def test_non_dump_pt_files_are_schema_errors(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(ArtifactSchemaError, match="expected slime's debug rollout dump"):
        import_slime_pt(str(path))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(ArtifactSchemaError, match="not a readable torch .pt file|refusing"):
        import_slime_pt(str(junk))
