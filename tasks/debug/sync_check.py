"""Check 5: after the first update every engine tensor equals the trainer's (names mapped)."""

from __future__ import annotations

from typing import Any

from rollflow.tasks.debug.checks import FAIL, PASS, CheckResult
from rollflow.tasks.sync.parity import ParityReport

NAME = "weight_sync_parity"

CAUSES = [
    "parameter names mapped wrong trainer -> engine (e.g. layer ids of the second pipeline stage not offset by "
    "the first stage's layer count; fused qkv / gate_up split in the wrong order)",
    "a tensor corrupted or cast in transit: dtype conversion, partial or chunked update, bucket ordering",
    "layers swapped or duplicated by the name mapping",
    "tied weights (embedding / lm_head) updated on one side only",
]


def sync_check(
    report: ParityReport | None,
    *,
    weight_version: int | None = None,
    error: str | None = None,
    transit: str | None = None,
    compared_in: str | None = None,
) -> CheckResult:
    """`compared_in`: the dtype both sides were hashed in (the engine's; trainer tensors cast to it)."""
    figures: dict[str, Any] = {}
    if report is not None:
        figures.update(
            {
                "n_tensors": report.n_tensors,
                "n_mismatched": len(report.mismatched),
                "first_mismatch": (report.mismatched or [None])[0],
                "weight_version": weight_version,
                "n_missing_in_engine": len(report.missing_in_engine),
                "n_unexpected_in_engine": len(report.unexpected_in_engine),
                "first_problem": report.first_problem,
                "mismatched": report.mismatched[:10],
                "missing_in_engine": report.missing_in_engine[:10],
                "unexpected_in_engine": report.unexpected_in_engine[:10],
            }
        )
    figures.setdefault("weight_version", weight_version)
    if compared_in is not None:
        figures["compared_in"] = compared_in
    if transit:
        figures["injected"] = transit
    if error is not None:
        return CheckResult(NAME, FAIL, figures, f"weight update raised: {error}", list(CAUSES))
    assert report is not None
    if not report.ok:
        first = report.mismatched[0] if report.mismatched else report.first_problem
        return CheckResult(
            NAME,
            FAIL,
            figures,
            f"engine weights differ from the trainer's after the update; first mismatching tensor: {first} "
            f"({len(report.mismatched)} mismatched, {len(report.missing_in_engine)} missing, "
            f"{len(report.unexpected_in_engine)} unexpected of {report.n_tensors})",
            list(CAUSES),
        )
    return CheckResult(
        NAME,
        PASS,
        figures,
        f"all {report.n_tensors} engine tensors equal the trainer's (fingerprints of dtype, shape and every bit"
        f"{', in ' + compared_in if compared_in else ''}) at weight_version {weight_version}",
    )
