"""Suite 2: rollout artifact write/read vs a raw fsspec copy of the same bytes, on file:// and loopback S3.

- store write: `RolloutStore.write` of `SampleColumns` (the columns an engine produces: vectorized
  contract checks, parquet encode by pyarrow, xxh3-128 over the encoded bytes, payload, then the
  manifest; on local disks fsync + exclusive link of each);
- store read: `RolloutStore.load_columns` (manifest, payload read into Arrow memory and hashed chunk
  by chunk, digest check, native parquet decode into columns);
- raw: `fs.pipe_file` / `fs.cat_file` of the same encoded payload bytes, nothing else (no fsync; a raw
  write + fsync is timed beside it on file://, without a goal, to show what durability costs).
Ratio = raw seconds / store seconds, paired per repeat (1.0 = as fast as the raw copy); goals from issues
23 and 37 (>= 50% of raw on file://, >= 70% on S3). The `Sample`-object API (write from / read into
`Sample` lists) is timed too, and the codec and digests alone, so each gap can be attributed.

A 67M-token rollout (512 prompts x 16 samples x (1,024 + 7,168) tokens; scaled down with --quick) is
written and read in fresh processes (benchmarks/artifact_memory.py), once per repeat, for its store / raw
ratios and the peak memory of load, load + batch build (`batch_from_columns`) and `rollflow show` (once),
against the artifact's size.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

from benchmarks.core import REPO, BenchContext, Goal, SuiteResult, ratios

TITLE = "artifact I/O: RolloutStore vs raw fsspec bytes"
GOALS = {"file": Goal(">=", 0.5, ">= 50% of raw"), "s3": Goal(">=", 0.7, ">= 70% of raw")}
MEMORY_GOAL = Goal("<=", 2.0, "<= 2x artifact")


def params_for(ctx: BenchContext) -> dict:
    big = dict(big_prompts=512, big_per_prompt=16, big_prompt_len=1024, big_response_len=7168)
    if ctx.quick:
        return dict(
            samples=512,
            tokens=1024,
            response_len=768,
            big_prompts=32,
            big_per_prompt=16,
            big_prompt_len=256,
            big_response_len=768,
        )
    return dict(samples=4096, tokens=1024, response_len=768, **big)


def run(ctx: BenchContext) -> SuiteResult:
    from fsspec.core import url_to_fs

    from benchmarks.models import synthetic_samples
    from rollflow.artifacts.codec import columns_from_parquet, columns_to_parquet
    from rollflow.artifacts.columns import SampleColumns
    from rollflow.artifacts.digests import hexdigest
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore
    from rollflow.tasks.train.batch import batch_from_samples
    from rollflow.tasks.train.batch_columns import batch_from_columns

    res = SuiteResult("artifact_io", TITLE)
    p = params_for(ctx)
    p.update(ctx.options.get("artifact_io", {}))
    repeats = ctx.n(3, 2)
    samples = synthetic_samples(p["samples"], p["tokens"] - p["response_len"], p["response_len"], 32000, group=8)
    columns = SampleColumns.from_samples(samples)
    payload = columns_to_parquet(columns).to_pybytes()
    mb = len(payload) / 1e6
    res.params = {
        **{k: v for k, v in p.items() if not k.startswith("big_")},
        "repeats": repeats,
        "payload_mb": round(mb, 2),
        "columns_mb": round(columns.nbytes / 1e6, 2),
        "columns": "tokens int32 list, loss_mask int8 list, rollout_log_probs float64 list + scalars "
        "(payload format rollflow.samples/2: ids uncompressed, log-probs byte-stream-split + lz4, the rest zstd; "
        "manifest schema 3, xxh3-128 digests)",
    }

    c: dict[str, list[float]] = {
        k: [] for k in ("enc", "dec", "xxh", "sha", "from_samples", "to_samples", "batch_columns", "batch_samples")
    }
    for _ in range(repeats):
        for key, fn in (
            ("enc", lambda: columns_to_parquet(columns)),
            ("dec", lambda: columns_from_parquet(payload)),
            ("xxh", lambda: hexdigest(payload, "xxh3_128")),
            ("sha", lambda: hashlib.sha256(payload).hexdigest()),
            ("from_samples", lambda: SampleColumns.from_samples(samples)),
            ("to_samples", lambda: columns.to_samples()),
            ("batch_columns", lambda: batch_from_columns(columns, group_size=8)),
            ("batch_samples", lambda: batch_from_samples(samples, group_size=8)),
        ):
            t0 = time.perf_counter()
            fn()
            c[key].append(time.perf_counter() - t0)
    res.add("parquet encode (columns)", "s", c["enc"])
    res.add("parquet decode (columns)", "s", c["dec"])
    res.add("xxh3-128 of the payload", "s", c["xxh"], note=f"{mb / _median(c['xxh']):.0f} MB/s: the store's digest")
    res.add(
        "sha256 of the payload",
        "s",
        c["sha"],
        note=f"{mb / _median(c['sha']):.0f} MB/s: the digest of manifests before schema 3 (still verified in those)",
    )
    res.add("Samples -> columns", "s", c["from_samples"], note="only callers that hold Sample lists pay it")
    res.add("columns -> Samples", "s", c["to_samples"], note="only when a caller asks for Sample objects")
    res.add("batch_from_columns", "s", c["batch_columns"])
    res.add("batch_from_samples", "s", c["batch_samples"])
    res.ratio("batch build: samples / columns time", ratios(c["batch_samples"], c["batch_columns"]))

    backends: dict[str, tuple[str, dict]] = {"file": (str(ctx.workdir / "artifact-io"), {})}
    if ctx.services is not None:
        try:
            backends["s3"] = ("s3://bench/artifact-io", ctx.services.s3_options())
        except Exception as exc:  # noqa: BLE001 - no moto / s3fs here: report, keep going
            res.unavailable["s3 (moto)"] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        res.unavailable["s3 (moto)"] = "needs the benchmark services (moto, s3fs)"

    engine = EngineInfo(backend="bench", model="synthetic", weight_version=0)
    for label, (root, options) in backends.items():
        store = RolloutStore(root, options)
        fs, base = url_to_fs(root, **options)
        fs.makedirs(f"{base}/raw", exist_ok=True)
        t: dict[str, list[float]] = {k: [] for k in ("raw_w", "raw_wf", "raw_r", "st_w", "st_r", "sm_w", "sm_r")}
        run = f"io-{uuid.uuid4().hex[:8]}"
        for i in range(repeats + 1):  # the first round warms connections and caches
            raw_path = f"{base}/raw/{run}-{i}.parquet"
            rounds = {
                "raw_w": lambda: fs.pipe_file(raw_path, payload),
                "raw_wf": (lambda: _write_fsync(f"{raw_path}.fsync", payload)) if label == "file" else None,
                "st_w": lambda: store.write(
                    run, "train", 2 * i, columns, n_samples_per_prompt=8, engine=engine, config_hash="bench"
                ),
                "sm_w": lambda: store.write(
                    run, "train", 2 * i + 1, samples, n_samples_per_prompt=8, engine=engine, config_hash="bench"
                ),
                "raw_r": lambda: fs.cat_file(raw_path),
                "st_r": lambda: store.load_columns(run, "train", 2 * i),
                "sm_r": lambda: store.load(run, "train", 2 * i + 1).samples,
            }
            for key, fn in rounds.items():
                if fn is None:
                    continue
                fs.invalidate_cache()
                t0 = time.perf_counter()
                fn()
                if i:
                    t[key].append(time.perf_counter() - t0)
        goal = GOALS[label]
        res.add(f"{label} raw write", "MB/s", [mb / x for x in t["raw_w"]])
        if t["raw_wf"]:
            res.add(f"{label} raw write + fsync", "MB/s", [mb / x for x in t["raw_wf"]], note="durable, as the store")
        res.add(f"{label} store write", "MB/s", [mb / x for x in t["st_w"]], note="payload MB / time from columns")
        res.add(
            f"{label} store write from Samples",
            "MB/s",
            [mb / x for x in t["sm_w"]],
            note="the Sample-list API: + Samples -> columns",
        )
        res.add(f"{label} raw read", "MB/s", [mb / x for x in t["raw_r"]])
        res.add(f"{label} store read", "MB/s", [mb / x for x in t["st_r"]], note="payload MB / time to columns")
        res.add(
            f"{label} store read into Samples",
            "MB/s",
            [mb / x for x in t["sm_r"]],
            note="load + artifact.samples: + columns -> Samples",
        )
        floor_w = _median(c["enc"]) + _median(c["xxh"])
        w_limit = (
            f"parquet encode ({_median(c['enc']):.3f} s) + xxh3-128 ({_median(c['xxh']):.4f} s) alone take "
            f"{floor_w / _median(t['raw_w']):.1f}x the raw write ({_median(t['raw_w']):.4f} s)"
            + (", and the store fsyncs payload and manifest" if label == "file" else "")
        )
        floor_r = _median(c["dec"]) + _median(c["xxh"])
        r_limit = (
            f"parquet decode ({_median(c['dec']):.3f} s) + xxh3-128 ({_median(c['xxh']):.4f} s) alone take "
            f"{floor_r / _median(t['raw_r']):.1f}x the raw read ({_median(t['raw_r']):.4f} s)"
        )
        res.ratio(
            f"{label} write: raw / store time", ratios(t["raw_w"], t["st_w"]), goal=goal, limit=w_limit, unit="fraction"
        )
        res.ratio(
            f"{label} read: raw / store time", ratios(t["raw_r"], t["st_r"]), goal=goal, limit=r_limit, unit="fraction"
        )
        if t["raw_wf"]:
            res.ratio(
                f"{label} write: raw + fsync / store time",
                ratios(t["raw_wf"], t["st_w"]),
                unit="fraction",
                note="reference without a goal: the raw copy made as durable as the store's",
            )
        res.ratio(f"{label} write from Samples: raw / store time", ratios(t["raw_w"], t["sm_w"]), unit="fraction")
        res.ratio(f"{label} read into Samples: raw / store time", ratios(t["raw_r"], t["sm_r"]), unit="fraction")
        try:
            fs.rm(base, recursive=True)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass

    try:
        _big_rollout(ctx, res, p)
    except Exception as exc:  # noqa: BLE001 - the memory case must not lose the figures above
        res.unavailable["67M-token rollout"] = f"{type(exc).__name__}: {exc}"[:300]
    return res


def _big_rollout(ctx: BenchContext, res: SuiteResult, p: dict) -> None:
    """The realistic-scale rollout: store throughput against raw (each repeat a fresh rollout, written and loaded
    in fresh processes), and peak memory of load, load + batch and `rollflow show`."""
    from fsspec.core import url_to_fs

    root = str(ctx.workdir / "artifact-big")
    n = p["big_prompts"] * p["big_per_prompt"]
    tokens = n * (p["big_prompt_len"] + p["big_response_len"])
    tag = f"{tokens / 1e6:.0f}M-token"
    shape = (p["big_prompts"], p["big_per_prompt"], p["big_prompt_len"], p["big_response_len"])
    fs, base = url_to_fs(root)
    writes, loads, raw_w, raw_r = [], [], [], []
    for i in range(ctx.n(3, 1)):
        run = f"big{i}"
        if i:
            fs.rm(f"{base}/big{i - 1}", recursive=True)  # one 0.5 GB payload on disk at a time
        writes.append(_child("write", root, run, *shape))
        payload_path = f"{base}/{run}/rollouts/train/000000/samples.parquet"
        t0 = time.perf_counter()
        data = fs.cat_file(payload_path)
        raw_r.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fs.pipe_file(f"{base}/raw-copy.parquet", data)
        raw_w.append(time.perf_counter() - t0)
        del data
        fs.rm(f"{base}/raw-copy.parquet")
        loads.append(_child("load", root, run))
    shown = _child("show", root, run)
    payload, cols = writes[-1]["payload_bytes"], loads[-1]["columns_bytes"]
    mb = payload / 1e6
    batch_bytes = loads[-1]["batch_bytes"]
    res.params["big"] = {
        "samples": n,
        "tokens": tokens,
        "prompt_len": p["big_prompt_len"],
        "response_len": p["big_response_len"],
        "payload_mb": round(mb, 1),
        "columns_mb": round(cols / 1e6, 1),
        "batch_mb": round(batch_bytes / 1e6, 1),
        "repeats": len(writes),
    }
    write_s = [w["write_s"] for w in writes]
    load_s = [x["load_s"] for x in loads]
    res.add(f"{tag} store write", "MB/s", [mb / x for x in write_s], note="persisting the rollout from columns")
    res.add(f"{tag} store read", "MB/s", [mb / x for x in load_s], note="loading it to columns")
    res.add(f"{tag} batch_from_columns", "s", [x["batch_s"] for x in loads])
    res.ratio(
        f"{tag} file write: raw / store time",
        ratios(raw_w, write_s),
        goal=GOALS["file"],
        unit="fraction",
        limit="parquet encode and the store's two fsyncs against a page-cache copy; see the 4,096 x 1,024 figures",
    )
    res.ratio(
        f"{tag} file read: raw / store time",
        ratios(raw_r, load_s),
        goal=GOALS["file"],
        unit="fraction",
        limit="parquet decode against a page-cache copy",
    )
    load_peak = [x["load_peak"] for x in loads]
    both_peak = [x["load_batch_peak"] for x in loads]
    art = "columns in memory"
    res.ratio(
        f"{tag} load peak / artifact",
        [x / cols for x in load_peak],
        goal=MEMORY_GOAL,
        unit="x",
        note=f"peak {_median(load_peak) / 1e6:.0f} MB over {art} {cols / 1e6:.0f} MB "
        f"(payload on disk {mb:.0f} MB: {_median(load_peak) / payload:.2f}x)",
    )
    res.ratio(
        f"{tag} load + batch peak / artifact",
        [x / cols for x in both_peak],
        goal=MEMORY_GOAL,
        unit="x",
        note=f"peak {_median(both_peak) / 1e6:.0f} MB; the TrainBatch's own tensors are {batch_bytes / 1e6:.0f} MB",
        limit=f"TrainBatch holds {batch_bytes / tokens:.0f} bytes per token (int64 tokens [B, L]; "
        "float32 loss mask and log-probs, bool span [B, L-1]; mask and positions follow from row "
        f"lengths): {batch_bytes / cols:.1f}x the columns, built while the columns are held",
    )
    extra = _median(both_peak) - cols - batch_bytes
    res.ratio(
        f"{tag} load + batch peak / (artifact + TrainBatch)",
        [x / (cols + batch_bytes) for x in both_peak],
        unit="x",
        note=f"transient memory beyond the columns and the batch: {extra / 1e6:.0f} MB",
    )
    res.ratio(
        f"{tag} show peak / artifact",
        [shown["show_peak"] / cols],
        goal=MEMORY_GOAL,
        unit="x",
        note=f"`rollflow show` engine (metrics + one page): peak {shown['show_peak'] / 1e6:.0f} MB, "
        f"{shown['show_s']:.1f} s",
        limit="show's metrics copy the response tokens to int64 and hash n-grams as uint64 (repetition)",
    )
    res.notes.append(
        f"{tag} case: artifact size = its columns in memory ({cols / 1e6:.0f} MB; issue 23's '~0.8 GB with "
        f"log-probs'); the payload on disk is {mb:.0f} MB. Peaks are high-water RSS above the process's RSS "
        "before the step, each role in a fresh process."
    )
    res.data["big"] = {"write_s": write_s, "load_s": load_s, "raw_write_s": raw_w, "raw_read_s": raw_r}


def _child(role: str, *args) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.artifact_memory", role, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"artifact_memory {role} failed (rc {proc.returncode}): {proc.stderr[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _write_fsync(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
