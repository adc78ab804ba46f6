"""Weights in buckets of bounded size (one update request or broadcast each)."""

from __future__ import annotations

from typing import Any, Iterable


def buckets_by_bytes(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterable[list[tuple[str, Any]]]:
    """Consecutive groups of (name, tensor) of at most `bucket_bytes` (a larger tensor is alone). A tensor
    whose element size does not divide the bytes before it starts a new group: SGLang's flattened
    buckets view each slice back as its dtype, which needs an aligned start."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or size % tensor.element_size()):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
