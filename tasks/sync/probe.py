"""The post-sync probe's shared half: what to probe with, and the comparison (docs/checks.md).

Checksum parity proves the engine holds the trainer's tensors; it cannot see what the engine *serves*: a
stale KV / prefix cache, a CUDA graph or compiled step captured before the update, a model copy the update
did not reach, a buffer outside the state dict (RoPE `inv_freq`, tasks/model/dtypes.py). The probe asks the
engine to generate a few short continuations of fixed prompts with a fixed seed, has the trainer score the
same tokens teacher-forced, and compares the log-probs: after a good sync they agree to the dtype's noise
(docs/architecture.md section 10: ~1e-5 in fp32), a stale engine is off by what the weights moved.

Both sides import this module (tasks/rollout generates, tasks/train scores), so it holds plain data only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

# Seed of the probe's sampling: fixed for the whole run, so every probe draws the same way from its weights.
PROBE_SEED = 20_261_204


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """The probe's sequences: the first `prompts` prompts of train rollout 0 (fixed for the run), each
    continued for at most `tokens` tokens, sampled with `seed` at the rollout temperature from the full
    softmax (sampled, not greedy: sampled tokens sit where log-probs move with the weights)."""

    prompts: int = 4
    tokens: int = 16
    seed: int = PROBE_SEED


@dataclasses.dataclass(frozen=True)
class ProbeBounds:
    """Largest mean |engine - trainer| log-prob a good sync may show, per dtype of the lower-precision side."""

    float32: float = 1e-3
    bfloat16: float = 5e-2

    def for_dtypes(self, *dtypes: str) -> tuple[str, float]:
        """The bound of the least precise of `dtypes` (config names) and that dtype's name. Anything below fp32
        (bf16, fp16, SGLang's 'auto' = the checkpoint's half dtype) gets the bf16 bound; fp64 the fp32 one."""
        half = [d for d in dtypes if d not in ("float32", "float64")]
        if half:
            return half[0], self.bfloat16
        return "float32", self.float32


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """One probe: the numbers the sync task fails with, and the metric `sync/probe_logprob_diff`."""

    mean_abs_diff: float
    max_abs_diff: float
    tokens: int
    sequences: int
    dtype: str
    bound: float
    weight_version: int

    @property
    def ok(self) -> bool:
        # NaN (a side produced non-finite log-probs) fails too: `nan <= bound` is False.
        return self.tokens > 0 and self.mean_abs_diff <= self.bound

    def summary(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        why = (
            ""
            if self.ok
            else (
                " (no token was generated)"
                if self.tokens == 0
                else ": the engine serves other weights than it holds (a stale cache, graph or model copy) or scores "
                "with another dtype / config"
            )
        )
        return (
            f"sync probe {verdict} at weight version {self.weight_version}: mean |engine - trainer| log-prob "
            f"{self.mean_abs_diff:.3g} (bound {self.bound:g} for {self.dtype}), max {self.max_abs_diff:.3g}, "
            f"over {self.tokens} tokens of {self.sequences} sequences{why}"
        )


def compare_probe(
    engine: Sequence[Sequence[float]],
    trainer: Sequence[Sequence[float]],
    *,
    dtype: str,
    bound: float,
    weight_version: int,
) -> ProbeReport:
    """Per-token |engine - trainer| over every probe sequence (the two lists are the same sequences in order)."""
    if len(engine) != len(trainer):
        raise ValueError(f"probe: the engine scored {len(engine)} sequences, the trainer {len(trainer)}")
    diffs: list[float] = []
    for row, (e, t) in enumerate(zip(engine, trainer)):
        if len(e) != len(t):
            raise ValueError(f"probe sequence {row}: the engine scored {len(e)} tokens, the trainer {len(t)}")
        diffs.extend(abs(a - b) for a, b in zip(e, t))
    mean = math.fsum(diffs) / len(diffs) if diffs else math.nan
    return ProbeReport(
        mean_abs_diff=mean,
        max_abs_diff=max(diffs, default=math.nan),
        tokens=len(diffs),
        sequences=len(engine),
        dtype=dtype,
        bound=bound,
        weight_version=weight_version,
    )
