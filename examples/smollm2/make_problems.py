"""Write the example's prompt sets: short one-step math word problems with numeric answers.

    python -m examples.smollm2.make_problems      # rewrites problems.jsonl (80) and eval.jsonl (16)

Deterministic (fixed seed); the files are committed, so running this is only needed to change them.
Numbers stay small: SmolLM2-135M gets some right and some wrong, which is what GRPO needs (a group
whose samples all score the same carries no advantage).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NAMES = [
    "Ana",
    "Ben",
    "Carla",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Mia",
    "Noah",
    "Olga",
    "Pablo",
]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "coins"]

TEMPLATES = {
    "add": [
        ("{n} has {a} {t}. {p} gives {n} {b} more {t}. How many {t} does {n} have now?", lambda a, b: a + b),
        ("There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in total?", lambda a, b: a + b),
    ],
    "sub": [
        ("{n} had {a} {t} and gave {b} of them to {p}. How many {t} does {n} have left?", lambda a, b: a - b),
        ("A shop had {a} {t}. It sold {b}. How many {t} are left in the shop?", lambda a, b: a - b),
    ],
    "mul": [
        ("{n} buys {a} bags with {b} {t} in each bag. How many {t} does {n} buy?", lambda a, b: a * b),
        ("Each of {a} children has {b} {t}. How many {t} do the children have together?", lambda a, b: a * b),
    ],
    "div": [
        ("{n} shares {c} {t} equally among {b} friends. How many {t} does each friend get?", None),
    ],
}


def problem(rng: random.Random, op: str) -> dict:
    template, fn = rng.choice(TEMPLATES[op])
    n, p = rng.sample(NAMES, 2)
    t = rng.choice(THINGS)
    if op == "add":
        a, b = rng.randint(2, 30), rng.randint(2, 20)
    elif op == "sub":
        a = rng.randint(10, 40)
        b = rng.randint(1, a - 1)
    elif op == "mul":
        a, b = rng.randint(2, 6), rng.randint(2, 9)
    else:
        b, answer = rng.randint(2, 6), rng.randint(2, 8)
        return {"question": template.format(n=n, p=p, t=t, b=b, c=b * answer), "answer": str(answer), "op": op}
    return {"question": template.format(n=n, p=p, t=t, a=a, b=b), "answer": str(fn(a, b)), "op": op}


def write(path: Path, n: int, seed: int, prefix: str) -> None:
    rng = random.Random(seed)
    ops = ["add", "sub", "mul", "div"]
    rows = []
    for i in range(n):
        row = problem(rng, ops[i % len(ops)])
        rows.append({"id": f"{prefix}{i:03d}", **row})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write(HERE / "problems.jsonl", 80, seed=2026, prefix="train-")
    write(HERE / "eval.jsonl", 16, seed=7, prefix="eval-")
    print("wrote", HERE / "problems.jsonl", HERE / "eval.jsonl")
