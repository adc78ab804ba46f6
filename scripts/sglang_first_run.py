"""First run of rollflow with real SGLang servers on a GPU machine, one command:

    python scripts/sglang_first_run.py --model /models/Qwen2.5-0.5B-Instruct

Runs one RL iteration per weight-sync path, each with 1 engine and 1 trainer rank and slime's
whole-tensor check at startup (debug.check_weight_update_equal: snapshot the engine's weights,
randomise them, sync from the trainer, compare value for value), then prints a table:

    path         placement      GPUs  result  startup check  parity  version  seconds
    disk         disaggregated  2     ok      ok             1.0     1        ...
    distributed  disaggregated  2     ok      ...
    tensor       colocate       1     ok      ...

Needs rollflow with the `sglang` extra on the machine (docs/sglang.md), 2 GPUs for the disaggregated
paths (`--paths tensor` runs on one), and a local Ray head it starts itself (or --ray-address). Each
path runs as its own `rollflow train` process; its log is under --out. Exit status 0 when every path
passed. Knobs: --paths, --set (extra overrides for every run), --timeout. Like `rollflow train`, the
runs use PREFECT_API_URL or start a local Prefect server (`rollflow server stop` stops it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PATHS = {
    # weight sync -> (placement, resources)
    "disk": ("disaggregated", {"num_gpus": 2, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1}),
    "distributed": ("disaggregated", {"num_gpus": 2, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1}),
    "tensor": ("colocate", {"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1}),
}


def overrides(path: str, args, run: str) -> list[str]:
    placement, resources = PATHS[path]
    sets = [
        f"run={run}",
        f"model.path={args.model}",
        f"store.root={args.out}",
        "iterations=1",
        "eval_every=0",
        "rollout.engine=sglang",
        f"rollout.sglang.weight_sync={path}",
        f"placement={placement}",
        "debug.check_weight_update_equal=true",
        "train.device=cuda",
        f"data.prompts_per_rollout={args.prompts}",
        f"ray.address={args.ray_address}",
    ]
    sets += [f"resources.{k}={v}" for k, v in resources.items()]
    if placement == "colocate":
        sets.append("offload=true")
    return sets + list(args.set)


def last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "FAILED" in ln or "error" in ln:
            return ln[:160]
    return lines[-1][:160] if lines else ""


def run_path(path: str, args) -> dict:
    run = f"sglang-first-{path}-{int(time.time())}"
    log = Path(args.out) / f"{run}.log"
    cmd = [sys.executable, "-m", "rollflow.flows.cli", "train"]
    for item in overrides(path, args, run):
        cmd += ["--set", item]
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.monotonic() - started
    metrics = Path(args.out) / run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    row = rows[-1] if rows else {}
    text = log.read_text(errors="replace")
    check = "FAILED" if "weight update check FAILED" in text else ("ok" if rows else "not reached")
    ok = rc == 0 and row.get("sync/parity_ok") == 1.0 and check == "ok"
    return {
        "path": path,
        "placement": PATHS[path][0],
        "gpus": PATHS[path][1]["num_gpus"],
        "result": "ok" if ok else f"FAIL ({rc})",
        "check": check,
        "parity": row.get("sync/parity_ok", "-"),
        "version": row.get("sync/weight_version", "-"),
        "seconds": f"{seconds:.0f}",
        "note": "" if ok else last_error(log),
        "log": str(log),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF model directory SGLang can serve (config.json + safetensors)")
    ap.add_argument(
        "--paths", default="disk,distributed,tensor", help="comma-separated subset of disk,distributed,tensor"
    )
    ap.add_argument("--out", default="runs-sglang-first", help="store root and logs")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--ray-address", default="local", help="'local' starts a Ray instance per run; 'auto' joins one")
    ap.add_argument("--set", action="append", default=[], help="extra --set override for every run (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = [run_path(p.strip(), args) for p in args.paths.split(",") if p.strip()]
    cols = ["path", "placement", "gpus", "result", "check", "parity", "version", "seconds", "note"]
    heads = ["path", "placement", "GPUs", "result", "startup check", "parity", "version", "seconds", "note"]
    widths = [max(len(h), *(len(str(r[c])) for r in results)) for h, c in zip(heads, cols)]
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
    for r in results:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    for r in results:
        print(f"log {r['path']}: {r['log']}")
    return 0 if all(r["result"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
