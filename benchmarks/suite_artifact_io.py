"""Suite 2: rollout artifact write/read vs a raw fsspec copy of the same bytes, on file:// and loopback S3.

- store write: `RolloutStore.write` from `Sample`s (validate, parquet encode, sha256, payload, then
  the manifest; on local disks fsync + atomic rename / exclusive link);
- store read: `RolloutStore.load` (manifest, payload, sha256 check, parquet decode into `Sample`s);
- raw: `fs.pipe_file` / `fs.cat_file` of the encoded payload bytes, nothing else.
Ratio = raw seconds / store seconds, paired per repeat (1.0 = as fast as the raw copy). The encode and
decode times are measured on their own too, so the gap can be attributed.
"""

from __future__ import annotations

import time
import uuid

from benchmarks.core import BenchContext, Goal, SuiteResult, ratios

TITLE = "artifact I/O: RolloutStore vs raw fsspec bytes"
GOAL = Goal(">=", 0.9, ">= 90% of raw")


def params_for(ctx: BenchContext) -> dict:
    if ctx.quick:
        return dict(samples=512, tokens=1024, response_len=768)
    return dict(samples=4096, tokens=1024, response_len=768)


def run(ctx: BenchContext) -> SuiteResult:
    from fsspec.core import url_to_fs

    from rollflow.artifacts.codec import samples_from_parquet_bytes, samples_to_parquet_bytes
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore
    from benchmarks.models import synthetic_samples

    res = SuiteResult("artifact_io", TITLE)
    p = params_for(ctx)
    p.update(ctx.options.get("artifact_io", {}))
    repeats = ctx.n(3, 2)
    samples = synthetic_samples(p["samples"], p["tokens"] - p["response_len"], p["response_len"], 32000, group=8)
    payload = samples_to_parquet_bytes(samples)
    mb = len(payload) / 1e6
    res.params = {**p, "repeats": repeats, "payload_mb": round(mb, 2),
                  "columns": "tokens int64 list, loss_mask int8 list, rollout_log_probs float64 list + scalars"}

    enc_s, dec_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        samples_to_parquet_bytes(samples)
        t1 = time.perf_counter()
        samples_from_parquet_bytes(payload)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
    res.add("parquet encode", "s", enc_s)
    res.add("parquet decode", "s", dec_s)

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
        t: dict[str, list[float]] = {k: [] for k in ("raw_w", "raw_r", "st_w", "st_r", "io_w", "io_r")}
        run = f"io-{uuid.uuid4().hex[:8]}"
        for i in range(repeats + 1):  # the first round warms connections and caches
            raw_path = f"{base}/raw/{run}-{i}.parquet"
            rounds = {
                "raw_w": lambda: fs.pipe_file(raw_path, payload),
                "st_w": lambda: store.write(run, "train", 2 * i, samples, n_samples_per_prompt=8, engine=engine,
                                            config_hash="bench"),
                "io_w": lambda: _without_codec(lambda: store.write(
                    run, "train", 2 * i + 1, samples, n_samples_per_prompt=8, engine=engine, config_hash="bench"),
                    payload, samples),
                "raw_r": lambda: fs.cat_file(raw_path),
                "st_r": lambda: store.load(run, "train", 2 * i),
                "io_r": lambda: _without_codec(lambda: store.load(run, "train", 2 * i + 1), payload, samples),
            }
            for key, fn in rounds.items():
                fs.invalidate_cache()
                t0 = time.perf_counter()
                fn()
                if i:
                    t[key].append(time.perf_counter() - t0)
        res.add(f"{label} raw write", "MB/s", [mb / x for x in t["raw_w"]])
        res.add(f"{label} store write", "MB/s", [mb / x for x in t["st_w"]], note="payload MB / time from Samples")
        res.add(f"{label} store write without codec", "MB/s", [mb / x for x in t["io_w"]],
                note="validation + sha256 + payload + manifest commit; parquet encode stubbed out")
        res.add(f"{label} raw read", "MB/s", [mb / x for x in t["raw_r"]])
        res.add(f"{label} store read", "MB/s", [mb / x for x in t["st_r"]], note="payload MB / time to Samples")
        res.add(f"{label} store read without codec", "MB/s", [mb / x for x in t["io_r"]],
                note="manifest + payload + sha256 check; parquet decode stubbed out")
        w_limit = (f"parquet encode from Python Sample lists ({_median(enc_s):.2f} s) against a raw write of "
                   f"{_median(t['raw_w']):.3f} s")
        r_limit = (f"parquet decode into Python Sample objects ({_median(dec_s):.2f} s) against a raw read of "
                   f"{_median(t['raw_r']):.3f} s")
        res.ratio(f"{label} write: raw / store time", ratios(t["raw_w"], t["st_w"]), goal=GOAL, limit=w_limit,
                  unit="fraction")
        res.ratio(f"{label} read: raw / store time", ratios(t["raw_r"], t["st_r"]), goal=GOAL, limit=r_limit,
                  unit="fraction")
        res.ratio(f"{label} write without codec: raw / store time", ratios(t["raw_w"], t["io_w"]), unit="fraction",
                  note="what the commit protocol, validation and checksums cost"
                       + ("; the store fsyncs, raw pipe_file does not" if label == "file" else ""))
        res.ratio(f"{label} read without codec: raw / store time", ratios(t["raw_r"], t["io_r"]), unit="fraction",
                  note="what the manifest read and checksum verification cost")
        try:
            fs.rm(base, recursive=True)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
    return res


def _without_codec(fn, payload: bytes, samples):
    """Run a store call with the parquet codec replaced by precomputed results (I/O path only)."""
    import rollflow.artifacts.store as store_mod

    enc, dec = store_mod.samples_to_parquet_bytes, store_mod.samples_from_parquet_bytes
    store_mod.samples_to_parquet_bytes = lambda _samples: payload
    store_mod.samples_from_parquet_bytes = lambda _data: samples
    try:
        return fn()
    finally:
        store_mod.samples_to_parquet_bytes, store_mod.samples_from_parquet_bytes = enc, dec


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
