"""Issue 39's GPU benchmarks at their tiny CPU shapes, so the commands scripts/moe_lora_gpu.sh runs cannot rot.

Each module runs as a child process with Prefect and Ray blocked before anything is imported (the GPU box has
neither), then its JSON is checked: the R3 mismatch on `builtin:addition-moe` in bf16 (where a few near-tie routes
flip and replay removes their share: tests/test_routing_replay.py), and LoRA's trainable parameters against
full-parameter training's on the demo's built-in model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCKED = "import runpy, sys; sys.modules['prefect'] = None; sys.modules['ray'] = None; "


def run_module(module: str, args: list[str], out: Path) -> tuple[int, dict, str]:
    code = BLOCKED + f"sys.argv = [{module!r}, *sys.argv[1:]]; runpy.run_module({module!r}, run_name='__main__')"
    command = [sys.executable, "-c", code, *args, "--device", "cpu", "--threads", "1", "--out", str(out), "--no-table"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.returncode, json.loads(out.read_text()), proc.stderr


def test_routing_replay_mismatch_tiny(tmp_path):
    rc, report, stderr = run_module("benchmarks.routing_replay_mismatch", ["--shape", "tiny"], tmp_path / "r3.json")
    suite = report["suites"]["routing_replay_mismatch"]
    assert rc == 0 and "error" not in suite, stderr[-4000:]
    assert report["schema"] == "rollflow.bench/1" and report["benchmark"] == "routing_replay_mismatch"
    params = suite["params"]
    assert params["shape"] == "tiny" and params["model"] == "builtin:addition-moe" and params["dtype"] == "bfloat16"
    assert (params["moe_layers"], params["top_k"], params["experts"]) == (2, 2, 8)
    assert params["active_params"] < params["params"]
    m = report["mismatch"]
    load = params["workload"]
    assert 0 < m["tokens"] <= load["prompts"] * load["samples_per_prompt"] * load["new_tokens"]
    assert m["route_slots"] == m["tokens"] * 2 and 0 <= m["route_flips"] <= m["route_slots"]
    off, on = m["without_r3"], m["with_r3"]
    assert 0 < on["mean"] <= off["mean"] and on["max"] <= off["max"]
    assert m["mean_ratio"] == pytest.approx(on["mean"] / off["mean"]) and m["r3_lowers_mismatch"] is True
    if m["route_flips"] == 0:  # nothing to replay: the same forward either way
        assert on == off
    figures = {f["name"]: f["median"] for f in suite["figures"]}
    assert figures["mismatch mean without R3"] == pytest.approx(off["mean"])
    assert figures["mismatch max with R3"] == pytest.approx(on["max"])
    assert {"generate", "score_without_r3", "score_with_r3"} <= set(suite["data"]["seconds"])
    assert suite["data"]["peak_gpu_memory_gib"] == {}  # nothing to measure on CPU
    assert "R3 lowers the mismatch: pass" in stderr


def test_lora_memory_tiny(tmp_path):
    args = ["--shapes", "tiny", "--warmup", "1", "--steps", "2"]
    rc, report, stderr = run_module("benchmarks.lora_memory", args, tmp_path / "lora.json")
    suite = report["suites"]["lora_memory"]
    assert rc == 0 and "error" not in suite, stderr[-4000:]
    assert report["benchmark"] == "lora_memory"
    lora_params = suite["params"]["lora"]
    assert (lora_params["rank"], lora_params["alpha"]) == (16, 32.0)
    tiny = report["lora_memory"]["tiny"]
    full, lora = tiny["full"], tiny["lora"]
    assert full["backend"] == "torch" and full["trainable_params"] == full["params"]
    assert 0 < lora["trainable_params"] < full["trainable_params"]
    assert lora["params"] == full["params"] + lora["trainable_params"]  # the frozen base plus the adapter
    for m in (full, lora):
        assert len(m["step_s_all"]) == 2 and m["step_s"] > 0
        assert len(m["losses"]) == 3 and all(loss == loss for loss in m["losses"])  # no NaN
        assert "peak_gib" not in m  # no GPU memory on CPU
    assert tiny["lora_over_full"]["trainable_params"] == pytest.approx(
        lora["trainable_params"] / full["trainable_params"]
    )
    names = {f["name"] for f in suite["figures"]}
    assert {"tiny full trainable params", "tiny lora trainable params", "tiny step time lora / full"} <= names
