"""The IMA triage's reproducer: one rollout-only generation on pinned prompts, with the cell's toggles.

    python -m rollflow.tasks.debug.ima_repro --config CONFIG_JSON --toggles '{"cuda_graph": "on"}' \
        [--crash-when cuda_graph=on,speculative=on] [--fault auto|abort|raise|triton_oob|device_assert]

The generation path is the rollout-only flow's without Prefect or Ray: `RolloutWorker.rollout(rollout_id)`
(prompts are a pure function of the data config and the rollout id, so they are pinned) through the `hf`
engine and transformers' `generate`. The toggles become `generate` keyword arguments (see
`rollflow.tasks.debug.ima.HFToggles`), injected around the engine model's `generate`; the engine code is unchanged.

Debug switch: with `--crash-when`, a logits processor armed only in cells that match the condition faults
inside a decode step (`--fault-step`, default 1 = the first decode step after prefill):
- `abort` (CPU default): `os.abort()`, the process dies by SIGABRT, as a native crash does;
- `raise`: a RuntimeError carrying a CUDA-style message (CPU tests of the log scan);
- `triton_oob` (CUDA default): a tiny Triton kernel stores 2**40 elements past the logits buffer, a real
  illegal memory access (`tasks/debug/ima_kernels.py`);
- `device_assert`: an out-of-range index on the GPU (a device-side assert).

Exit status: 0 generated, `EXIT_UNSUPPORTED` (78) the backend cannot run this cell, else a failure.
Under `CUDA_LAUNCH_BLOCKING=1` the last Triton kernel launched before an error is printed (it is the
kernel that faulted, since every launch then waits for its kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Sequence

from rollflow.tasks.debug.ima import load_config_arg
from rollflow.tasks.debug.ima_logs import EXIT_UNSUPPORTED
from rollflow.tasks.debug.ima_toggles import Cell, HFToggles, backend_toggles, format_toggles, parse_toggles
from rollflow.tasks.model.teacher_forced import ScoringLayout
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.train.settings import OptimConfig

FAULTS = ("auto", "abort", "raise", "triton_oob", "device_assert")
_TRACE: dict[str, Any] = {"installed": False, "last": None}


class Unsupported(Exception):
    """The backend cannot run this cell (reported as n/a)."""


def _launch_blocking() -> bool:
    return os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0")


def install_launch_trace() -> bool:
    """Remember the name of every Triton kernel launched (Triton's launch-enter hook)."""
    try:
        import triton
    except ImportError:
        return False

    def enter(metadata) -> None:
        try:
            data = metadata if isinstance(metadata, dict) else metadata.get()
            _TRACE["last"] = data.get("name")
        except Exception:  # tracing must never change what the run does
            pass

    try:
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        hook = getattr(runtime, "launch_enter_hook", None) if runtime is not None else None
        if hook is not None and hasattr(hook, "add"):  # Triton's hook chain
            hook.add(enter)
        elif runtime is not None and hasattr(runtime, "launch_enter_hook") and hook is None:
            runtime.launch_enter_hook = enter
        elif runtime is None:
            from triton.compiler import CompiledKernel  # older Triton

            CompiledKernel.launch_enter_hook = enter
        else:
            return False
    except Exception as exc:  # tracing must never change what the run does
        print(f"rollflow-ima: no Triton launch trace ({type(exc).__name__}: {exc})", flush=True)
        return False
    _TRACE["installed"] = True
    return True


def report_last_kernel() -> None:
    if _TRACE["installed"] and _TRACE["last"] and _launch_blocking():
        print(
            f"rollflow-ima: last Triton kernel launched before the error: {_TRACE['last']}", file=sys.stderr, flush=True
        )


def fire(kind: str, scores, step: int) -> None:
    """Fault now, inside the decode step that produced `scores`."""
    if kind == "auto":
        kind = "triton_oob" if scores.is_cuda else "abort"
    print(f"rollflow-ima: injected fault {kind} in decode step {step}", file=sys.stderr, flush=True)
    if kind == "abort":
        os.abort()
    if kind == "raise":
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered (simulated by the rollflow-ima 'raise' fault)"
        )
    if not scores.is_cuda:
        raise ValueError(f"fault {kind!r} needs the engine on a CUDA device (rollout.device=cuda)")
    if kind == "triton_oob":
        from rollflow.tasks.debug.ima_kernels import oob_store  # local: keeps Triton optional (this fault only)

        oob_store(scores)
        return
    if kind == "device_assert":
        import torch

        bad = torch.full((1,), scores.shape[-1] + 12345, dtype=torch.long, device=scores.device)
        scores.index_fill_(-1, bad, 0.0)
        return
    raise ValueError(f"fault {kind!r}: expected one of {', '.join(FAULTS)}")


def fault_processor(kind: str, step: int):
    """A logits processor that faults once, at decode step `step` (0 = the prefill's logits)."""
    from transformers import LogitsProcessor

    class FaultInjector(LogitsProcessor):
        def __init__(self) -> None:
            self.calls = 0
            self.fired = False

        def __call__(self, input_ids, scores):
            current = self.calls
            self.calls += 1
            if current >= step and not self.fired:
                self.fired = True
                fire(kind, scores, current)
            return scores

    return FaultInjector()


def install_generate_overrides(model, generate_kwargs: dict, *, fault=None, max_cache_headroom: int = 0) -> None:
    """Wrap `model.generate` so every call gets the cell's keyword arguments (and the armed fault).

    `max_cache_len="auto"`: the static cache is sized prompt width + max_new_tokens + headroom.
    """
    original = model.generate

    def generate(*args, **kwargs):
        extra = dict(generate_kwargs)
        if extra.get("max_cache_len") == "auto":
            ids = kwargs.get("input_ids", args[0] if args else None)
            width = int(ids.shape[1]) if ids is not None else 0
            extra["max_cache_len"] = width + int(kwargs.get("max_new_tokens") or 0) + max_cache_headroom + 1
        merged = {**kwargs, **extra}
        if fault is not None:
            from transformers import LogitsProcessorList

            processors = LogitsProcessorList(list(kwargs.get("logits_processor") or []))
            processors.append(fault)
            merged["logits_processor"] = processors
        return original(*args, **merged)

    model.generate = generate  # an instance attribute: HFEngine's `self.model.generate(...)` finds it


def run(args: argparse.Namespace) -> dict:
    config = load_config_arg(args.config)
    cell = Cell.from_toggles(args.toggles)
    crash_when = parse_toggles(args.crash_when) if args.crash_when is not None else None
    options = {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens} if args.backend == "hf" else {}
    mapping = backend_toggles(args.backend, **options)
    plan = mapping.plan(cell)
    if not plan.applicable:
        raise Unsupported(plan.reason)
    if args.backend != "hf":
        raise Unsupported(
            f"engine {args.backend!r} is not in this build; its flags for this cell would be: "
            f"{' '.join(plan.engine_flags)}"
        )

    rollout = RolloutConfig.model_validate({**config.get("rollout", {}), **plan.rollout_overrides})
    data = DataConfig.model_validate(config.get("data", {}))
    model_spec = (config.get("model") or {}).get("path", "builtin:addition")
    armed = crash_when is not None and cell.matches(crash_when)
    print(
        f"rollflow-ima: cell {cell.label}; {plan.describe()}; fault "
        + (
            f"armed ({args.fault} at decode step {args.fault_step}, crash-when {format_toggles(crash_when)})"
            if armed
            else "not armed"
        ),
        flush=True,
    )
    scoring = None
    if rollout.logprobs == "teacher_forced":  # the run's config asks the engine to rescore like its trainer
        scoring = ScoringLayout.of(OptimConfig.model_validate(config.get("train", {})))
    worker = RolloutWorker(model_spec, rollout, data, scoring=scoring)
    headroom = mapping.prompt_lookup_num_tokens if isinstance(mapping, HFToggles) else 0
    fault = fault_processor(args.fault, args.fault_step) if armed else None
    install_generate_overrides(worker.engine.model, plan.generate_kwargs, fault=fault, max_cache_headroom=headroom)
    import torch

    on_cuda = worker.engine.device.type == "cuda"
    if on_cuda and _launch_blocking():
        print(
            f"rollflow-ima: Triton launch trace {'on' if install_launch_trace() else 'unavailable'} "
            "(CUDA_LAUNCH_BLOCKING=1)",
            flush=True,
        )
    started = time.perf_counter()
    n, lengths, statuses = 0, 0, {}
    try:
        for rollout_id in args.rollout_ids:
            samples = worker.rollout(rollout_id)
            n += len(samples)
            lengths += sum(s.response_length for s in samples)
            for s in samples:
                key = str(getattr(s.status, "value", s.status))
                statuses[key] = statuses.get(key, 0) + 1
    except ValueError as exc:
        reason = unsupported_combination(exc, fault_fired=bool(fault is not None and fault.fired))
        if reason:
            raise Unsupported(reason) from exc
        raise
    if on_cuda:
        torch.cuda.synchronize()  # an asynchronous fault surfaces here at the latest
    import transformers

    return {
        "cell": cell.toggles(),
        "samples": n,
        "mean_response_length": lengths / max(n, 1),
        "statuses": statuses,
        "seconds": round(time.perf_counter() - started, 3),
        "device": str(worker.engine.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if on_cuda else None,
        "generate_kwargs": plan.generate_kwargs,
    }


def unsupported_combination(exc: BaseException, *, fault_fired: bool) -> str | None:
    """Why transformers refused this cell's combination, if that is what `exc` is (else None).

    transformers validates `generate` arguments before any kernel runs and says "not supported" (e.g. 5.17:
    "assisted generate is not supported with Static cache classes"); such a cell is n/a for this version,
    not a crash. Anything after the armed fault fired stays a failure.
    """
    if fault_fired or not isinstance(exc, ValueError) or "not supported" not in str(exc):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not any("transformers" in f.filename and "generation" in f.filename for f in frames[-1:]):
        return None
    try:
        import transformers

        version = transformers.__version__
    except ImportError:
        version = "?"
    return f"transformers {version} cannot run this combination: {exc}"


def _parse_ids(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollflow.tasks.debug.ima_repro", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="RunConfig JSON (inline or a file)")
    ap.add_argument("--toggles", default=None, help="cell: JSON or cuda_graph=on,speculative=off,deepep=off")
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--crash-when", default=None, help="arm the fault in cells matching this (e.g. cuda_graph=on)")
    ap.add_argument("--fault", default="auto", choices=FAULTS)
    ap.add_argument("--fault-step", type=int, default=1, help="decode step that faults (0 = prefill logits)")
    ap.add_argument("--rollout-ids", type=_parse_ids, default=[0])
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=HFToggles.prompt_lookup_num_tokens)
    args = ap.parse_args(argv)
    if "CUDA_ENABLE_COREDUMP_ON_EXCEPTION" not in os.environ:
        try:  # an abort must not leave a multi-GB host core file behind
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ImportError, ValueError, OSError):
            pass
    try:
        result = run(args)
    except Unsupported as exc:
        print(f"rollflow-ima: unsupported: {exc}", flush=True)
        return EXIT_UNSUPPORTED
    except BaseException:
        traceback.print_exc()
        report_last_kernel()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # after a CUDA fault the context is unusable: skip interpreter teardown
    print("rollflow-ima: result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
