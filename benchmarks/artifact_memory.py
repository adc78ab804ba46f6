"""Peak memory of one artifact step, measured in a fresh process (`python -m benchmarks.artifact_memory`).

Roles (one per process, so one step's peak is not hidden by another's):
- `write ROOT RUN PROMPTS PER_PROMPT PROMPT_LEN RESPONSE_LEN`: synthetic columns built with numpy, committed
  with `RolloutStore.write`;
- `load ROOT RUN`: `load_columns` then `batch_from_columns` (what replay / the trainer do);
- `show ROOT RUN`: `rollflow show`'s engine: metrics over the columns and one printed page.

Peak = the process's high-water RSS (VmHWM, reset through /proc/self/clear_refs after the imports) minus
its RSS at that point: what the step itself added. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Peak:
    """High-water RSS above the RSS at construction (bytes)."""

    def __init__(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        self.base = _status_kib("VmRSS") * 1024

    def now(self) -> int:
        return _status_kib("VmHWM") * 1024 - self.base


def _columns(prompts: int, per_prompt: int, prompt_len: int, response_len: int):
    import numpy as np

    from rollflow.artifacts.columns import ListColumn, SampleColumns

    n = prompts * per_prompt
    rng = np.random.default_rng(0)
    length = prompt_len + response_len
    tokens = ListColumn(
        np.arange(n + 1, dtype=np.int64) * length, rng.integers(3, 32000, size=n * length, dtype=np.int32)
    )
    # Engines report float32 log-probs: stored as float64 they carry float32's precision, as here.
    log_probs = -rng.random(n * response_len, dtype=np.float32).astype(np.float64) * 4
    return SampleColumns.from_arrays(
        group_index=np.arange(n) // per_prompt,
        index=np.arange(n),
        tokens=tokens,
        response_length=np.full(n, response_len),
        loss_mask=np.ones(n * response_len, dtype=np.int8),
        rollout_log_probs=log_probs,
        reward=(rng.random(n) > 0.5).astype(np.float64),
        status="truncated",
        prompt=[f"prompt {i // per_prompt}" for i in range(n)],
    )


def main(argv: list[str]) -> dict:
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore

    role, root, run = argv[0], argv[1], argv[2]
    store = RolloutStore(root)
    out: dict = {"role": role}
    if role == "write":
        prompts, per_prompt, prompt_len, response_len = (int(x) for x in argv[3:7])
        columns = _columns(prompts, per_prompt, prompt_len, response_len)
        out["columns_bytes"] = columns.nbytes
        out["tokens"] = int(columns.list_column("tokens").values.size)
        peak = Peak()
        t0 = time.perf_counter()
        store.write(
            run,
            "train",
            0,
            columns,
            n_samples_per_prompt=per_prompt,
            engine=EngineInfo(backend="bench", model="synthetic", weight_version=0),
            config_hash="bench",
        )
        out["write_s"] = time.perf_counter() - t0
        out["write_peak"] = peak.now()
        out["payload_bytes"] = store.manifest(run, "train", 0).file("samples.parquet").size
    elif role == "load":
        import torch

        from rollflow.tasks.train.batch_columns import batch_from_columns

        torch.set_num_threads(1)
        peak = Peak()
        t0 = time.perf_counter()
        columns = store.load_columns(run, "train", 0)
        out["load_s"] = time.perf_counter() - t0
        out["load_peak"] = peak.now()
        out["columns_bytes"] = columns.nbytes
        t1 = time.perf_counter()
        batch = batch_from_columns(columns, group_size=store.manifest(run, "train", 0).n_samples_per_prompt)
        out["batch_s"] = time.perf_counter() - t1
        out["load_batch_peak"] = peak.now()
        out["batch_bytes"] = sum(
            t.numel() * t.element_size() for t in vars(batch).values() if isinstance(t, torch.Tensor)
        )
    elif role == "show":
        from rollflow.tasks.debug.display import load_sample_table, page_records, rollout_metrics

        peak = Peak()
        t0 = time.perf_counter()
        table = load_sample_table(store, run, "train", 0)
        metrics = rollout_metrics(table)
        page_records(table, limit=20)
        out["show_s"] = time.perf_counter() - t0
        out["show_peak"] = peak.now()
        out["n_samples"] = metrics.get("n_samples")
    else:
        raise SystemExit(f"unknown role {role!r}")
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
