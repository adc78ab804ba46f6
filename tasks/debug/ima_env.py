"""IMA triage: the environment of one pass (the CUDA launch-blocking and core-dump variables) and the reproducer's
command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from rollflow.tasks.debug.ima_toggles import Cell

# Passes: the matrix itself, then reruns of one failing cell.
MATRIX, LAUNCH_BLOCKING, COREDUMP = "matrix", "launch_blocking", "coredump"


# CUDA core dump environment (cuda-gdb manual, "GPU core dump support"; CUcoredumpGenerationFlags in the
# driver API). These flags leave out device memory contents and non-relocated ELF images; the dump still
# records the faulting kernel, PC, registers and the exception (a torch process's dump was 197 MB on the H200).
COREDUMP_GENERATION_FLAGS = "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory"
CUDA_DEBUG_VARS = (
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_ENABLE_COREDUMP_ON_EXCEPTION",
    "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION",
    "CUDA_ENABLE_LIGHTWEIGHT_COREDUMP",
    "CUDA_ENABLE_USER_TRIGGERED_COREDUMP",
    "CUDA_COREDUMP_FILE",
    "CUDA_COREDUMP_PIPE",
    "CUDA_COREDUMP_GENERATION_FLAGS",
    "CUDA_COREDUMP_SHOW_PROGRESS",
)


def cell_env(
    pass_name: str,
    *,
    coredump_dir: str | Path | None = None,
    cell_key: str = "cell",
    generation_flags: str = COREDUMP_GENERATION_FLAGS,
) -> dict[str, str]:
    """The CUDA debug variables of one pass (everything else inherits; inherited debug vars are dropped)."""
    env: dict[str, str] = {}
    if pass_name == LAUNCH_BLOCKING:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    elif pass_name == COREDUMP:
        if coredump_dir is None:
            raise ValueError("the core-dump pass needs a coredump_dir")
        env.update(
            {
                "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
                "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION": "0",  # the GPU dump only (a torch host core is GBs)
                "CUDA_COREDUMP_SHOW_PROGRESS": "1",
                "CUDA_COREDUMP_GENERATION_FLAGS": generation_flags,
                # %h host, %p pid (the driver expands them)
                "CUDA_COREDUMP_FILE": str(Path(coredump_dir) / f"core_{cell_key}_%h_%p.nvcudmp"),
            }
        )
    elif pass_name != MATRIX:
        raise ValueError(f"pass {pass_name!r}: expected {MATRIX}, {LAUNCH_BLOCKING} or {COREDUMP}")
    return env


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def repro_command(
    config_json: str,
    cell: Cell,
    *,
    backend: str = "hf",
    crash_when: str | None = None,
    fault: str | None = None,
    rollout_ids: Sequence[int] = (0,),
    python: str | None = None,
) -> list[str]:
    cmd = [
        python or sys.executable,
        "-m",
        "rollflow.tasks.debug.ima_repro",
        "--config",
        config_json,
        "--toggles",
        json.dumps(cell.toggles()),
        "--backend",
        backend,
        "--rollout-ids",
        ",".join(str(i) for i in rollout_ids),
    ]
    if crash_when is not None:
        cmd += ["--crash-when", crash_when]
    if fault:
        cmd += ["--fault", fault]
    return cmd
