"""Reward functions: built-ins, any function named by a dotted path, or a reward server over HTTP.

A per-sample reward function takes one `Sample` and returns a float or a dict (then `reward_key`
picks the field used for training). A per-group function takes the samples of one prompt (a list)
and returns one reward per sample; mark it with `@group_reward` or set `rollout.reward_scope=group`.
Either kind may be `async def`; many async calls run concurrently.

Built-ins (`rollout.reward`): `addition`, `exact_match`, `math` (the `\\boxed{}` answer, else the
number after `####`, else the last number, compared numerically with the label), `f1` (token-overlap
F1). An `http(s)://` URL scores each sample on a reward server (`tasks/rollout/remote_reward.py`).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import string
import threading
from collections import Counter
from fractions import Fraction
from typing import Any, Callable

from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.addition import addition_reward
from rollflow.tasks.rollout.dotted import load_callable
from rollflow.tasks.rollout.feedback import feedback_reward
from rollflow.tasks.rollout.remote_reward import RemoteReward

RewardFn = Callable[[Sample], Any]
GROUP = "group"
SAMPLE = "sample"


def group_reward(fn: Callable[[list[Sample]], Any]) -> Callable[[list[Sample]], Any]:
    """Mark `fn(samples_of_one_prompt) -> list of rewards` as a per-group reward function."""
    fn.reward_scope = GROUP  # type: ignore[attr-defined]
    return fn


def reward_scope(fn: Any) -> str:
    return getattr(fn, "reward_scope", SAMPLE)


# ---- text normalisation and answer extraction ----------------------------------------------------

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None  # unbalanced: not a finished answer


def extract_last_number(text: str) -> str | None:
    """The last number in `text` ("1,234", "-3.5", "3/4"), as written; None if there is none."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def parse_number(text: str | None) -> Fraction | None:
    """'1,234' / '$12.50' / '3/4' / '\\frac{3}{4}' / '42.' -> an exact Fraction; None if not a number."""
    if text is None:
        return None
    t = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    t = re.sub(r"^\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", t)
    t = t.removeprefix("\\$").removesuffix("\\%").removesuffix("%")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The math answer of a response: the last `\\boxed{}` if any, else the number after the last
    GSM8K-style `####` marker, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        marked = _NUMBER.search(text.rsplit("####", 1)[1])
        if marked:
            return marked.group(0)
    return extract_last_number(text)


def _label_answer(label: str) -> str:
    """GSM8K-style labels ('... #### 42') and boxed labels reduce to their answer."""
    if "####" in label:
        return label.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(label)
    return boxed if boxed is not None else label.strip()


def math_equal(answer: str | None, label: str) -> bool:
    if answer is None:
        return False
    want = _label_answer(label)
    a, b = parse_number(answer), parse_number(want)
    if a is not None and b is not None:
        return a == b
    return _normalize_math(answer) == _normalize_math(want)


def _normalize_math(text: str) -> str:
    """Non-numeric answers ("x+1", "\\frac{a}{b}"): compared without spaces, $ and a final period."""
    return re.sub(r"\s+", "", text).strip("$").rstrip(".").lower()


def _normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's answer normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token-overlap F1 of normalised texts (1.0 when both are empty)."""
    pred, ref = _normalize_text(prediction).split(), _normalize_text(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# ---- built-in reward functions (per sample) --------------------------------------------------------


def _addition(sample: Sample) -> float:
    return addition_reward(sample.response, sample.label or "")


def exact_match_reward(sample: Sample) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    return 1.0 if sample.response.strip() == (sample.label or "").strip() else 0.0


def math_reward(sample: Sample) -> float:
    """1.0 when the response's answer (see `extract_answer`) equals the label's."""
    return 1.0 if math_equal(extract_answer(sample.response), sample.label or "") else 0.0


def f1_reward(sample: Sample) -> float:
    return f1_score(sample.response, sample.label or "")


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "addition": _addition,
    "exact_match": exact_match_reward,
    "math": math_reward,
    "f1": f1_reward,
}


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def resolve_reward_fn(spec: str, *, remote: Any = None) -> RewardFn:
    """A built-in name, `package.module:function` / `package.module.function`, or an http(s) URL.

    `remote` (a `RemoteRewardConfig`) sets the URL reward's timeout, retries and concurrency.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if is_url(spec):
        return RemoteReward.from_config(spec, remote)
    return load_callable(
        "rollout.reward",
        spec,
        f"a built-in ({', '.join(BUILTIN_REWARDS)}), a dotted path like 'my_pkg.rewards:score', "
        "or an http(s) URL of a reward server",
    )


def reward_fn_from_config(rollout: Any) -> RewardFn:
    """The reward function of a RolloutConfig (spec, remote settings, scope)."""
    if rollout.reward == "conversation_feedback":
        return feedback_reward(resolve_reward_fn(rollout.feedback.judge), rollout.feedback.votes)
    fn = resolve_reward_fn(rollout.reward, remote=getattr(rollout, "remote_reward", None))
    if getattr(rollout, "reward_scope", SAMPLE) == GROUP and reward_scope(fn) != GROUP:
        inner = fn

        def grouped(samples: list[Sample]) -> Any:
            return inner(samples)

        grouped.__name__ = getattr(inner, "__name__", "group_reward")
        fn = group_reward(grouped)
    return fn


# ---- scoring ---------------------------------------------------------------------------------------


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (async __call__)


def _run(coro: Any) -> Any:
    """asyncio.run, also from a thread that already runs an event loop (then in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="rollflow-reward")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call_all(fn: Any, args: list[Any]) -> list[Any]:
    """fn(arg) for every arg; coroutines (async fn, or a sync fn returning awaitables) run concurrently."""
    if _is_async(fn):

        async def gather_all() -> list[Any]:
            return list(await asyncio.gather(*(fn(a) for a in args)))

        return _run(gather_all())
    values = [fn(a) for a in args]
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:

        async def gather_pending() -> list[Any]:
            return list(await asyncio.gather(*(values[i] for i in pending)))

        for i, value in zip(pending, _run(gather_pending())):
            values[i] = value
    return values


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Samples split by prompt group (group_index), groups in order of first appearance."""
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s)
    return list(by_group.values())


def score_samples(
    samples: list[Sample], fn: RewardFn, *, reward_key: str | None = None, scope: str | None = None
) -> list[Sample]:
    """Set `reward` (and `reward_key`) on every sample in place; returns the same list.

    `scope` ('sample' or 'group') defaults to the function's own (`@group_reward`), else 'sample'.
    """
    scope = scope or reward_scope(fn)
    if scope == GROUP:
        groups = _groups(samples)
        results = _call_all(fn, groups)
        pairs: list[tuple[Sample, Any]] = []
        for group, rewards in zip(groups, results):
            rewards = list(rewards) if isinstance(rewards, (list, tuple)) else rewards
            if not isinstance(rewards, list) or len(rewards) != len(group):
                got = f"{len(rewards)} rewards" if isinstance(rewards, list) else type(rewards).__name__
                raise ValueError(
                    f"group reward function {getattr(fn, '__name__', fn)!r} returned {got} for group "
                    f"{group[0].group_index} of {len(group)} samples; return one reward per sample"
                )
            pairs.extend(zip(group, rewards))
    elif scope == SAMPLE:
        pairs = list(zip(samples, _call_all(fn, list(samples))))
    else:
        raise ValueError(f"reward scope {scope!r}: expected 'sample' or 'group'")
    for sample, reward in pairs:
        if isinstance(reward, dict):
            if reward_key is None or reward_key not in reward:
                raise ValueError(
                    f"reward function returned a dict with keys {sorted(reward)}; set rollout.reward_key to one of them"
                )
            sample.reward = reward
            sample.reward_key = reward_key
        else:
            sample.reward = float(reward)
    return samples
