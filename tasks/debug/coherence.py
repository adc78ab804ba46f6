"""Check 1: are rollouts language, not gibberish?

Figures: printable ratio of the responses, repetition fraction, share of responses in the task's
answer format (the addition task only), the reference model's mean negative log-likelihood of the
responses (teacher-forced, computed by the trainer) and, with an HF (BPE / sentencepiece)
tokenizer, the retokenize agreement: the share of response tokens that the tokenizer reproduces
when it re-encodes the decoded text. A model whose checkpoint was not loaded writes high-NLL noise,
confidently repeats one token, or - a real LM with shuffled weights, which can be confident about its
own noise - samples arbitrary id sequences that no tokenizer would produce (measured on SmolLM2-135M:
0.998 for its real rollouts, 0.92 with shuffled weights); all of these fail here.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.debug.checks import FAIL, PASS, AlignmentThresholds, CheckResult
from rollflow.tasks.model.tokenizer import is_hf_tokenizer

NAME = "coherence"

CAUSES = [
    "checkpoint not loaded: the engine (or trainer) runs random / initial weights; check model.path and the "
    "load step's log",
    "parameter names not mapped trainer -> engine (e.g. the layer ids of the second pipeline stage not offset "
    "by the first stage's layer count), so some tensors kept stale values",
    "engine buffers freed early: weights or KV cache released / offloaded (colocate memory release) before "
    "generation finished, or not restored after",
    "a pretrain (base) model driven with a chat template, or an instruct model without its template",
    "tokenizer does not belong to the model (vocabulary / alphabet mismatch)",
]


def answer_format(data_cfg: Any) -> str | None:
    """Regex a well-formed answer of the task matches (None when the task has no fixed format)."""
    if getattr(data_cfg, "task", None) == "addition":
        return rf"\d{{{int(data_cfg.digits) + 1}}}"
    return None


def repetition_fraction(tokens: list[int]) -> float:
    """Share of repeated token bigrams in one response: 0 for all-distinct, -> 1 for 'aaaa...'."""
    pairs = list(zip(tokens, tokens[1:]))
    return 1.0 - len(set(pairs)) / len(pairs) if pairs else 0.0


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            ids.add(int(value))
    return ids


def printable_units(tokenizer: Any, sample: Sample) -> tuple[int, int]:
    """(printable, total) units of one response: characters of the decoded text plus stray special
    tokens inside it (a final stop token is not counted). U+FFFD (undecodable) is not printable."""
    response = list(sample.response_tokens)
    specials = _special_ids(tokenizer)
    if response and Status.parse(sample.status) == Status.COMPLETED and response[-1] in specials:
        response = response[:-1]
    stray = sum(t in specials for t in response)
    text = tokenizer.decode([t for t in response if t not in specials]) if response else ""
    good = sum(ch != "\ufffd" and (ch.isprintable() or ch in "\n\t") for ch in text)
    return good, len(text) + stray


def retokenize_agreement(tokenizer: Any, samples: list[Sample]) -> float | None:
    """Share of response tokens found again when the decoded response is re-encoded (a multiset
    overlap, so one changed split costs a token or two, not the rest of the response).

    A model samples the token sequences its tokenizer produced in training; arbitrary id sequences
    (random or shuffled weights) decode to text that the tokenizer splits differently. None for
    rollflow's char tokenizer, where every sequence is canonical.
    """
    if not is_hf_tokenizer(tokenizer):
        return None
    specials = _special_ids(tokenizer)
    kept = total = 0
    for s in samples:
        ids = list(s.response_tokens)
        if ids and Status.parse(s.status) == Status.COMPLETED and ids[-1] in specials:
            ids = ids[:-1]
        if not ids:
            continue
        again = tokenizer(tokenizer.decode(ids, clean_up_tokenization_spaces=False), add_special_tokens=False)[
            "input_ids"
        ]
        kept += sum((Counter(ids) & Counter(again)).values())
        total += len(ids)
    return kept / total if total else None


def response_stats(tokenizer: Any, samples: list[Sample], pattern: str | None) -> dict[str, Any]:
    """Text-side figures of check 1; runs where the tokenizer lives (the rollout worker)."""
    good = total = 0
    for s in samples:
        g, t = printable_units(tokenizer, s)
        good, total = good + g, total + t
    n = max(len(samples), 1)
    stats: dict[str, Any] = {
        "n_samples": len(samples),
        "printable_ratio": good / total if total else 1.0,
        "repetition_fraction": sum(repetition_fraction(list(s.response_tokens)) for s in samples) / n,
        "mean_response_tokens": sum(s.response_length for s in samples) / n,
        "truncated_ratio": sum(Status.parse(s.status) == Status.TRUNCATED for s in samples) / n,
        "empty_ratio": sum(not s.response.strip() for s in samples) / n,
    }
    agreement = retokenize_agreement(tokenizer, samples)
    if agreement is not None:
        stats["retokenize_agreement"] = agreement
    if pattern is not None:
        rx = re.compile(pattern)
        stats["answer_format"] = pattern
        stats["format_fraction"] = sum(bool(rx.fullmatch(s.response.strip())) for s in samples) / n
    stats["examples"] = [s.response for s in samples[:8]]
    return stats


def coherence_check(
    stats: dict[str, Any], ref_nll: float | None, thr: AlignmentThresholds, *, reward_mean: float | None = None
) -> CheckResult:
    figures: dict[str, Any] = {
        "printable_ratio": stats["printable_ratio"],
        "repetition_fraction": stats["repetition_fraction"],
        "ref_nll": ref_nll,
    }
    if "format_fraction" in stats:
        figures["format_fraction"] = stats["format_fraction"]
    if "retokenize_agreement" in stats:
        figures["retokenize_agreement"] = stats["retokenize_agreement"]
    if reward_mean is not None:
        figures["reward_mean"] = reward_mean
    for key in ("n_samples", "mean_response_tokens", "truncated_ratio", "empty_ratio", "answer_format"):
        if key in stats:
            figures[key] = stats[key]
    figures["examples"] = stats.get("examples", [])

    problems = []
    if stats["printable_ratio"] < thr.min_printable_ratio:
        problems.append(f"printable_ratio {stats['printable_ratio']:.3f} < {thr.min_printable_ratio}")
    if stats["repetition_fraction"] > thr.max_repetition_fraction:
        problems.append(f"repetition_fraction {stats['repetition_fraction']:.3f} > {thr.max_repetition_fraction}")
    if ref_nll is None:
        problems.append("reference NLL unavailable (the trainer's step-1 scoring failed)")
    elif not ref_nll <= thr.max_ref_nll:  # NaN fails too
        problems.append(f"ref_nll {ref_nll:.3f} > {thr.max_ref_nll}")
    if (
        thr.min_format_fraction is not None
        and "format_fraction" in stats
        and stats["format_fraction"] < thr.min_format_fraction
    ):
        problems.append(
            f"format_fraction {stats['format_fraction']:.3f} < {thr.min_format_fraction} "
            f"(answers matching {stats.get('answer_format')})"
        )
    agreement = stats.get("retokenize_agreement")
    if thr.min_retokenize_agreement is not None and agreement is not None and agreement < thr.min_retokenize_agreement:
        problems.append(
            f"retokenize_agreement {agreement:.3f} < {thr.min_retokenize_agreement} (response tokens "
            "are not what the tokenizer produces for their own text: arbitrary id sequences)"
        )
    if problems:
        return CheckResult(NAME, FAIL, figures, "rollouts look like gibberish: " + "; ".join(problems), list(CAUSES))
    msg = (
        f"rollouts are language: printable {stats['printable_ratio']:.3f}, repetition "
        f"{stats['repetition_fraction']:.3f}, reference NLL {ref_nll:.3f}/token"
    )
    if "format_fraction" in stats:
        msg += f", {stats['format_fraction']:.1%} in answer format"
    if "retokenize_agreement" in stats:
        msg += f", retokenize agreement {stats['retokenize_agreement']:.3f}"
    return CheckResult(NAME, PASS, figures, msg)
