"""The trainer's memory fit check (tasks/train/memory_fit.py): parameter counts from safetensors headers, bytes per
parameter against Megatron's measured state, and the refusal of a model too big for where its state must live."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from rollflow.tasks.model.source import BUILTIN_MODELS, resolve_model_path
from rollflow.tasks.train.memory_fit import (
    GIB,
    TrainerDoesNotFit,
    fit_refusal,
    host_available_bytes,
    megatron_state,
    safetensors_params,
    torch_state,
    trainer_state,
)
from rollflow.tasks.train.settings import AlgoConfig, MegatronSettings, OptimConfig
from rollflow.tasks.train.worker import TrainWorker

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H100 = int(79.2 * GIB)  # what torch reports for an H100 80GB HBM3
H200 = int(139.8 * GIB)


def _qwen25_7b_params() -> int:
    """Qwen2.5-7B's shape with tied embeddings (the e2e suite's `7b`), counted by transformers on the meta device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.models import SHAPES

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["qwen2.5-7b"], tie_word_embeddings=True))
    return sum(p.numel() for p in model.parameters())


def test_safetensors_params_is_the_models_parameter_count(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("builtin:addition")))
    expected = sum(p.numel() for p in model.parameters())  # tied embedding counted once, as saved
    assert safetensors_params(resolve_model_path("builtin:addition")) == expected
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert safetensors_params(tmp_path) == expected


@pytest.mark.parametrize("shape", ["0.9b", "3b", "6b"])
def test_megatron_bytes_per_param_is_a_lower_bound_of_the_measured_state(shape):
    """The H200 fit sweep measured the memory Megatron's DDP + optimizer hold after a step (bf16, one GPU)."""
    measured = json.loads((RESULTS / f"h200-2026-12-03-megatron-fit-{shape}.json").read_text())
    state = megatron_state("bfloat16", "megatron", 1, False)
    assert state.gpu <= measured["state_bytes_per_param"] <= state.gpu * 1.01


@pytest.mark.parametrize("shape", ["0.5b", "1.5b", "5b"])
def test_the_bounds_are_below_what_the_h200_e2e_runs_held(shape):
    """The colocated e2e iterations on the H200 (megatron trainer, offload on, bf16 `hf` engine; both workers in the
    one process measured) peaked above both lower bounds: the GPU state (18 B per parameter) and what the host holds
    while the trainer trains (16 B parked by the trainer, 2 B of the engine's weights on its shelf)."""
    run = json.loads((RESULTS / f"h200-2026-12-06-e2e-{shape}.json").read_text())["suites"]["e2e"]
    figures = {f["name"]: f for f in run["figures"]}
    params = run["params"]["params"]
    state = megatron_state("bfloat16", "megatron", 1, False)
    assert params * state.gpu <= max(figures["peak GPU memory GiB"]["values"]) * GIB
    assert params * (state.parked + 2) <= figures["peak host memory GiB (process)"]["values"][0] * GIB
    host = int(125.7 * GIB)  # that machine's memory, all of it available before the run
    fits = dict(device="cuda", gpu_bytes=H200, host_bytes=host, parks_on_host=True, engine_host_bytes_per_param=2.0)
    assert fit_refusal(params, 1, state, **fits) is None


def test_the_7b_shape_is_refused_on_an_80gb_gpu_and_fits_with_tp2():
    params = _qwen25_7b_params()
    state = megatron_state("bfloat16", "megatron", 1, False)
    why = fit_refusal(params, 1, state, device="cuda", gpu_bytes=H100, host_bytes=None, parks_on_host=False)
    assert why is not None and why.startswith("train: ")
    assert f"{params * 18 / GIB:.1f} GiB" in why and "79.2 GiB" in why
    assert "train.megatron.tp" in why and "use_distributed_optimizer" in why
    assert fit_refusal(params, 2, state, device="cuda", gpu_bytes=H100, host_bytes=None, parks_on_host=False) is None
    assert fit_refusal(params, 1, state, device="cuda", gpu_bytes=H200, host_bytes=None, parks_on_host=False) is None


def test_offload_is_refused_when_the_parked_state_exceeds_host_memory():
    params = _qwen25_7b_params()
    state = megatron_state("bfloat16", "megatron", 1, False)
    parked = params * (2 + 12 + 2)  # bf16 weights, fp32 master + Adam m, v, the bf16 reference copy
    host = parked - GIB
    why = fit_refusal(params, 1, state, device="cuda", gpu_bytes=H200, host_bytes=host, parks_on_host=True)
    assert why is not None and why.startswith("offload: ") and "offload=false" in why
    assert f"{parked / GIB:.1f} GiB" in why
    # not parking: the same host memory is no concern
    assert fit_refusal(params, 1, state, device="cuda", gpu_bytes=H200, host_bytes=host, parks_on_host=False) is None
    assert fit_refusal(params, 1, state, device="cuda", gpu_bytes=H200, host_bytes=parked, parks_on_host=True) is None


def test_the_trainer_ranks_of_one_node_park_together():
    """Each rank checks before any of them loads, so each sees the whole MemAvailable: the parked state of the
    node's ranks adds up (8 x 0.5B data-parallel ranks park 8 x 16 B x 0.5B = 59.6 GiB)."""
    params = 500_000_000
    state = megatron_state("bfloat16", "megatron", 8, False)
    host = 40 * GIB
    one = dict(device="cuda", gpu_bytes=H100, host_bytes=host, parks_on_host=True)
    assert fit_refusal(params, 1, state, **one) is None  # one rank alone parks 7.5 GiB
    assert fit_refusal(params, 1, state, node_ranks=4, **one) is None  # 29.8 GiB
    why = fit_refusal(params, 1, state, node_ranks=8, **one)
    assert why is not None and why.startswith("offload: ") and "x 8 trainer ranks on this node" in why
    assert f"{8 * params * 16 / GIB:.1f} GiB" in why and "40.0 GiB available" in why
    # on CPU the whole state lives in host memory: 2 ranks of a 2 GiB-per-rank state need 4 GiB
    cpu_state = torch_state("float32", False)  # 20 B per parameter
    small = 100_000_000
    assert (
        fit_refusal(small, 1, cpu_state, device="cpu", gpu_bytes=None, host_bytes=3 * GIB, parks_on_host=False) is None
    )
    why = fit_refusal(
        small, 1, cpu_state, device="cpu", gpu_bytes=None, host_bytes=3 * GIB, parks_on_host=False, node_ranks=2
    )
    assert why is not None and "x 2 trainer ranks on this node" in why and f"{2 * small * 20 / GIB:.1f} GiB" in why


def test_the_engines_weights_kept_on_the_host_count_beside_the_parked_state():
    """A colocated `hf` engine parks its weights on a pinned host shelf while the trainer trains: 5.2B parameters
    with Megatron's bf16 state park 16 B each (77.5 GiB), and the engine's bf16 copy adds 2 B each (9.7 GiB), so a
    node with 80 GiB available passes without the engine and is refused with it, naming both."""
    params = 5_200_000_000
    state = megatron_state("bfloat16", "megatron", 1, False)
    assert state.parked == 16
    one = dict(device="cuda", gpu_bytes=H200, host_bytes=80 * GIB, parks_on_host=True)
    assert fit_refusal(params, 1, state, **one) is None
    why = fit_refusal(params, 1, state, engine_host_bytes_per_param=2.0, **one)
    assert why is not None and why.startswith("offload: ")
    assert f"parks {params * 18 / GIB:.1f} GiB at least" in why
    assert f"+ {params * 2 / GIB:.1f} GiB of the engines' weights on this node" in why
    # on CPU the engine's weights live in host memory all along: 100M parameters, fp32 torch state (20 B) and an
    # fp32 engine (4 B) need 2.2 GiB
    small = 100_000_000
    cpu = dict(device="cpu", gpu_bytes=None, host_bytes=2 * GIB, parks_on_host=False)
    assert fit_refusal(small, 1, torch_state("float32", False), **cpu) is None  # 1.9 GiB
    why = fit_refusal(small, 1, torch_state("float32", False), engine_host_bytes_per_param=4.0, **cpu)
    assert why is not None and f"= {small * 24 / GIB:.1f} GiB at least" in why


def test_the_group_counts_the_hf_engines_on_each_trainer_ranks_node(tmp_path, ray_local):
    """What the run's group tells each trainer rank about its node's engines: a colocated bf16 `hf` engine in the
    placement group on this node, 2 B per parameter; the CPU default (nothing placed, one-node Ray), its fp32
    engine's 4 B; an SGLang engine (its memory saver frees released weights) and a replay (no engine), 0."""
    from rollflow.flows.group import WorkerGroup
    from tests.conftest import small_config

    colocated = small_config(
        tmp_path,
        run="fit-engine",
        placement="colocate",
        rollout={"dtype": "bfloat16"},
        resources={"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1}
        | {"gpu_resource": "fake_gpu"},
    )
    group = WorkerGroup.for_run(colocated)
    assert group.plan is not None
    group.start_placement()
    try:
        assert group.trainer_node_sharing(1)[1] == [2.0]
    finally:
        group.stop_placement()
    assert WorkerGroup.for_run(small_config(tmp_path)).trainer_node_sharing(1)[1] == [4.0]
    sglang = small_config(tmp_path, rollout={"engine": "sglang", "sglang": {"urls": ["http://127.0.0.1:1"]}})
    assert WorkerGroup.for_run(sglang).trainer_node_sharing(1)[1] == [0.0]
    replay = small_config(tmp_path, debug={"train_only": True})
    assert WorkerGroup.for_run(replay).trainer_node_sharing(1)[1] == [0.0]


def test_bytes_per_param_by_backend():
    # the distributed optimizer shards fp32 master + m + v (12 B) over data parallel
    assert megatron_state("bfloat16", "megatron", 8, True).gpu == 2 + 4 + 12 / 8
    assert megatron_state("bfloat16", "megatron", 8, False).gpu == 2 + 4 + 12
    assert megatron_state("float32", "megatron", 1, False).gpu == 4 + 4 + 8  # no separate master copy
    # MasterAdamW: grads in the param dtype
    assert megatron_state("bfloat16", "torch", 1, False).gpu == 2 + 2 + 12
    # torch backend: AdamW moments in the param dtype, the reference model on the device
    assert torch_state("float32", False).gpu == 4 * 5
    assert torch_state("bfloat16", True).gpu == 2  # LoRA: the frozen base only
    megatron = OptimConfig(
        backend="megatron",
        dtype="bfloat16",
        device="cuda",
        megatron=MegatronSettings(tp=2, pp=2, use_distributed_optimizer=True),
    )
    state, sharing = trainer_state(megatron, 16, False)
    assert sharing == 4 and state.gpu == 2 + 4 + 12 / 4  # 16 ranks / (tp 2 x pp 2) = dp 4


def test_host_available_bytes_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1000 kB\nMemAvailable:   20971520 kB\n")
    assert host_available_bytes(str(meminfo)) == 20 * GIB
    assert host_available_bytes(str(tmp_path / "missing")) is None
    assert host_available_bytes() is not None  # this Linux box says


def _giant_model_dir(root: Path, params: int) -> Path:
    """The built-in model's directory (config, tokenizer) with its weights replaced by one bf16 tensor of
    `params` elements: a real safetensors file whose data part is a hole (sparse), never read."""
    model_dir = root / "giant"
    shutil.copytree(BUILTIN_MODELS["builtin:addition"], model_dir)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 2 * params]}}
    )
    header += " " * (-len(header) % 8)
    path = model_dir / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + 2 * params)
    return model_dir


def test_a_model_too_big_for_this_node_is_refused_before_any_weight_loads(tmp_path):
    available = host_available_bytes()
    params = 4 * available  # the torch backend in fp32 holds 20 B per parameter: far over what is available
    model_dir = _giant_model_dir(tmp_path, params)
    assert safetensors_params(model_dir) == params
    with pytest.raises(TrainerDoesNotFit, match=r"^train: .* this node's memory.*train\.device=cuda"):
        TrainWorker(str(model_dir), OptimConfig(), AlgoConfig(), store_root=f"file://{tmp_path}/s", run="r")


def test_a_trainer_actor_refusing_to_start_is_reported_as_its_one_line(tmp_path, ray_local):
    """Through Ray, as `rollflow train` starts it: Ray keeps only the text of the constructor's exception, and the
    command's error line is that refusal (exit 2), not "an actor died: run the command again"."""
    from rollflow.flows.cli.common import error_line
    from rollflow.infra.clients import TrainerClient
    from rollflow.infra.workers import start_actor, stop_actor

    model_dir = _giant_model_dir(tmp_path, 4 * host_available_bytes())
    actor = start_actor(
        "fit",
        "trainer",
        TrainWorker,
        str(model_dir),
        OptimConfig(),
        AlgoConfig(),
        store_root=f"file://{tmp_path}/s",
        run="fit",
        wait=False,
    )
    try:
        with pytest.raises(Exception) as raised:
            TrainerClient([actor]).wait_started()
    finally:
        stop_actor("fit", "trainer")
    message, code = error_line(raised.value)
    assert code == 2
    assert message.startswith("train: the trainer's state does not fit this node's memory: ") and "\n" not in message
