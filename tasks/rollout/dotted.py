"""User functions named in config by dotted path (`pkg.mod:fn` or `pkg.mod.fn`).

One loader for every such field (rollout.reward, rollout.function, the dynamic-sampling filter), so they
all accept the same two spellings and fail with the same one-line message naming the field.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load_callable(
    field: str, spec: str, expected: str = "a dotted path like 'my_pkg.module:function'"
) -> Callable[..., Any]:
    """The callable `spec` names; ValueError naming `field` when it is malformed, missing or not callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{field}={spec!r} is not {expected}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field}={spec!r}: {module_name!r} has no callable {attr!r}")
    return fn
