"""Typed results of the precision-alignment checks: `CheckResult`, `AlignmentReport`, thresholds.

Plain data, no torch, no Prefect: the check functions in tasks/ return `CheckResult`s, the flow and
the CLI render an `AlignmentReport` as markdown (Prefect UI, terminal), table rows and JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

CheckStatus = Literal["pass", "warn", "fail"]
PASS: CheckStatus = "pass"
WARN: CheckStatus = "warn"
FAIL: CheckStatus = "fail"
_RANK = {PASS: 0, WARN: 1, FAIL: 2}


def worst(*statuses: str) -> CheckStatus:
    return max(statuses, key=lambda s: _RANK[s], default=PASS)  # type: ignore[return-value]


@dataclasses.dataclass
class CheckResult:
    """One check: its verdict, the figures it was judged on and, unless it passed, the likely causes."""

    name: str
    status: CheckStatus
    figures: dict[str, Any]
    message: str
    causes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in _RANK:
            raise ValueError(f"CheckResult.status={self.status!r}: expected pass, warn or fail")

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "message": self.message,
            "figures": json_safe(self.figures),
            "causes": list(self.causes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        return cls(
            name=data["name"],
            status=data["status"],
            figures=dict(data.get("figures") or {}),
            message=data.get("message", ""),
            causes=list(data.get("causes") or []),
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AlignmentThresholds(_Strict):
    """Pass / warn / fail limits of the alignment checks (defaults fit fp32 engines and trainers).

    The defaults pass the built-in `builtin:addition` model with a wide margin and fail it with
    shuffled or random weights; bf16 engines usually need looser `mismatch_*` limits.
    """

    # 1. coherence: are rollouts language?
    min_printable_ratio: float = Field(0.95, ge=0, le=1, description="printable characters / all response units")
    max_repetition_fraction: float = Field(0.3, ge=0, le=1, description="mean share of repeated token bigrams")
    max_ref_nll: float = Field(1.5, gt=0, description="reference model's mean NLL per response token")
    min_format_fraction: Optional[float] = Field(
        0.5, ge=0, le=1, description="responses matching the task's answer format (None = not judged)"
    )
    min_retokenize_agreement: Optional[float] = Field(
        0.97,
        ge=0,
        le=1,
        description="HF tokenizers: share of response tokens the tokenizer reproduces when it "
        "re-encodes the decoded text (None = not judged)",
    )
    # 2. step 1: log_probs == ref_log_probs
    require_exact_ref_equality: bool = Field(True, description="log_probs must equal ref_log_probs bit for bit")
    ref_abs_tolerance: float = Field(0.0, ge=0, description="allowed max |log_prob - ref| when not exact")
    expected_max_neg_log_prob: float = Field(
        1.5, gt=0, description="warn when the mean -log_prob of step 1 is above this level"
    )
    # 3. train vs rollout log-probs
    mismatch_mean_warn: float = Field(1e-4, ge=0, description="warn above this mean |train - rollout| log-prob")
    mismatch_mean_fail: float = Field(1e-2, ge=0, description="fail above this mean |train - rollout| log-prob")
    mismatch_max_fail: float = Field(1.0, ge=0, description="fail above this max |train - rollout| log-prob")
    worst_samples: int = Field(5, ge=0, description="samples listed with the largest mismatch")
    mismatch_kl_warn: float = Field(1e-5, ge=0, description="warn above this rollout-vs-train KL (mismatch/k3_kl)")
    mismatch_kl_fail: float = Field(1e-3, ge=0, description="fail above this rollout-vs-train KL (mismatch/k3_kl)")
    # 4. one rollout, one step
    max_ppo_kl: float = Field(0.0, ge=0, description="|train/ppo_kl| allowed at the first step (0 = exact)")
    max_pg_clipfrac: float = Field(0.0, ge=0, le=1, description="train/pg_clipfrac allowed at the first step")
    max_grad_norm: float = Field(10.0, gt=0, description="grad norm (before clipping) allowed at the first step")
    # 6. step 2
    memory_budget_mb: Optional[float] = Field(
        None, gt=0, description="largest worker peak (host RSS or CUDA) allowed, MB; None = report only"
    )


@dataclasses.dataclass
class AlignmentReport:
    checks: list[CheckResult]
    context: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> CheckStatus:
        return worst(*(c.status for c in self.checks))

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.failed]

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {[c.name for c in self.checks]}")

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (PASS, WARN, FAIL)}

    def summary(self) -> str:
        n = self.counts()
        head = f"alignment {self.status.upper()}: {n[PASS]} pass, {n[WARN]} warn, {n[FAIL]} fail"
        if self.failed:
            head += "; failed: " + "; ".join(f"{c.name} ({c.message})" for c in self.failed)
        return head

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "counts": self.counts(),
            "context": json_safe(self.context),
            "checks": [c.to_dict() for c in self.checks],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AlignmentReport":
        return cls(checks=[CheckResult.from_dict(c) for c in data["checks"]], context=dict(data.get("context") or {}))

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per check (for a Prefect table artifact): status, headline figures, message."""
        rows = []
        for i, c in enumerate(self.checks, 1):
            scalars = [(k, v) for k, v in c.figures.items() if _is_scalar(v) or v is None][:4]
            rows.append(
                {
                    "#": i,
                    "check": c.name,
                    "status": c.status,
                    "figures": ", ".join(f"{k}={fmt(v)}" for k, v in scalars),
                    "message": c.message,
                }
            )
        return rows

    def to_markdown(self) -> str:
        ctx = self.context
        n = self.counts()
        title = f"# Precision alignment: run `{ctx.get('run', '?')}`"
        lines = [
            title,
            "",
            f"**Result: {self.status.upper()}** — {len(self.checks)} checks: {n[PASS]} pass, {n[WARN]} warn, "
            f"{n[FAIL]} fail",
        ]
        facts = [(k, ctx[k]) for k in ("created_at", "model", "engine", "trainer", "samples", "duration_s") if k in ctx]
        if facts:
            lines += ["", " · ".join(f"{k}: {fmt(v)}" for k, v in facts)]
        if ctx.get("faults"):
            lines += ["", "**Injected faults:** " + "; ".join(ctx["faults"])]
        lines += ["", "| # | check | status | figures | message |", "|---|---|---|---|---|"]
        for row in self.table_rows():
            lines.append(
                f"| {row['#']} | {row['check']} | {_badge(row['status'])} | {_cell(row['figures'])} | "
                f"{_cell(row['message'])} |"
            )
        for i, c in enumerate(self.checks, 1):
            lines += ["", f"## {i}. {c.name}: {c.status.upper()}", "", c.message, ""]
            for key, value in c.figures.items():
                if _is_scalar(value) or value is None:
                    lines.append(f"- `{key}`: {fmt(value)}")
            for key, value in c.figures.items():
                if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                    lines += ["", f"`{key}`:", "", *_md_table(value)]
                elif isinstance(value, (list, dict)) and not (isinstance(value, list) and not value):
                    lines.append(f"- `{key}`: {_cell(json.dumps(json_safe(value)))}")
            if c.causes:
                lines += ["", "Likely causes:", *[f"- {cause}" for cause in c.causes]]
        return "\n".join(lines) + "\n"


def _badge(status: str) -> str:
    return {PASS: "pass", WARN: "**warn**", FAIL: "**FAIL**"}[status]


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(rows: list[dict[str, Any]]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_cell(fmt(r.get(c))) for c in cols) + " |")
    return out


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        return f"{value:.4g}"
    if isinstance(value, str):
        return repr(value) if value != value.strip() or value == "" else value
    return str(value)


def json_safe(value: Any) -> Any:
    """Plain JSON types; non-finite floats become their string names (JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    try:  # numpy / torch scalars
        return json_safe(value.item())
    except AttributeError:
        return str(value)
