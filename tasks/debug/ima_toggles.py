"""IMA triage: the toggle matrix (CUDA graphs, speculative decoding, DeepEP) and what each backend does per cell."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

TOGGLES: tuple[str, ...] = ("cuda_graph", "speculative", "deepep")
ON, OFF = "on", "off"


# --------------------------------------------------------------------------------------------- toggles


def _onoff(value: Any, name: str) -> str:
    text = str(value).strip().lower()
    if text in ("on", "1", "true", "yes", "y"):
        return ON
    if text in ("off", "0", "false", "no", "n", "none"):
        return OFF
    raise ValueError(f"toggle {name}={value!r}: expected on or off")


def parse_toggles(spec: str | dict | None) -> dict[str, str]:
    """'cuda_graph=on,speculative=off', a JSON object, or a dict -> {toggle: 'on'|'off'}.

    `None`, '' and 'always' give {} (a condition every cell matches). Unknown toggle names are errors.
    """
    if spec is None:
        return {}
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        text = spec.strip()
        if text in ("", "always", "any", "*"):
            return {}
        if text.startswith("{"):
            items = list(json.loads(text).items())
        else:
            items = []
            for part in text.replace(";", ",").split(","):
                if not part.strip():
                    continue
                key, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(
                        f"toggle spec {spec!r}: {part!r} is not toggle=on|off (toggles: {', '.join(TOGGLES)})"
                    )
                items.append((key.strip(), value.strip()))
    out: dict[str, str] = {}
    for key, value in items:
        if key not in TOGGLES:
            raise ValueError(f"unknown toggle {key!r}; known: {', '.join(TOGGLES)}")
        out[key] = _onoff(value, key)
    return out


def format_toggles(toggles: dict[str, str]) -> str:
    return ",".join(f"{k}={toggles[k]}" for k in TOGGLES if k in toggles) or "always"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination of the toggles."""

    cuda_graph: bool = False
    speculative: bool = False
    deepep: bool = False

    @classmethod
    def from_toggles(cls, toggles: dict[str, str] | str | None) -> "Cell":
        parsed = parse_toggles(toggles)
        return cls(**{k: parsed.get(k, OFF) == ON for k in TOGGLES})

    def toggles(self) -> dict[str, str]:
        return {k: ON if getattr(self, k) else OFF for k in TOGGLES}

    def matches(self, condition: dict[str, str]) -> bool:
        mine = self.toggles()
        return all(mine[k] == v for k, v in condition.items())

    @property
    def key(self) -> str:
        """File-name safe id: cg1-sp0-ep0."""
        return f"cg{int(self.cuda_graph)}-sp{int(self.speculative)}-ep{int(self.deepep)}"

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.toggles().items())


def toggle_matrix() -> list[Cell]:
    """All 8 cells; deepep varies slowest (n/a cells of a backend without DeepEP come last)."""
    return [Cell(cuda_graph=cg, speculative=sp, deepep=ep) for ep, cg, sp in itertools.product((False, True), repeat=3)]


# ------------------------------------------------------------------------------ per-backend toggle maps


@dataclasses.dataclass(frozen=True)
class CellPlan:
    """What a backend does for one cell: flags / generate kwargs, or why the cell is not applicable."""

    cell: Cell
    backend: str
    applicable: bool
    reason: str = ""
    engine_flags: tuple[str, ...] = ()
    trainer_flags: tuple[str, ...] = ()
    generate_kwargs: dict = dataclasses.field(default_factory=dict)
    rollout_overrides: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.applicable:
            return f"n/a: {self.reason}"
        parts = []
        if self.engine_flags:
            parts.append("engine: " + " ".join(self.engine_flags))
        if self.trainer_flags:
            parts.append("trainer: " + " ".join(self.trainer_flags))
        if self.generate_kwargs:
            parts.append("generate: " + ", ".join(f"{k}={v!r}" for k, v in self.generate_kwargs.items()))
        if self.rollout_overrides:
            parts.append("rollout: " + ", ".join(f"{k}={v!r}" for k, v in self.rollout_overrides.items()))
        return "; ".join(parts) or "defaults"


def trainer_flags(cell: Cell) -> tuple[str, ...]:
    """Megatron trainer side of the deepep toggle (slime passes it straight to Megatron)."""
    return ("--moe-enable-deepep",) if cell.deepep else ()


@dataclasses.dataclass(frozen=True)
class SGLangToggles:
    """SGLang server flags per toggle (passthrough; what slime's `--sglang-*` arguments become)."""

    speculative_algorithm: str = "EAGLE"
    speculative_args: tuple[str, ...] = ()  # e.g. ("--speculative-draft-model-path", "/models/draft")
    deepep_mode: str = "auto"
    name: str = "sglang"

    def supports(self, toggle: str) -> bool:
        return toggle in TOGGLES

    def meaning(self, toggle: str) -> str:
        return {
            "cuda_graph": "off: --disable-cuda-graph",
            "speculative": f"on: --speculative-algorithm {self.speculative_algorithm}; off: no speculative flags",
            "deepep": f"on: --moe-a2a-backend deepep --deepep-mode {self.deepep_mode} (trainer "
            "--moe-enable-deepep); off: --moe-a2a-backend none",
        }[toggle]

    def plan(self, cell: Cell) -> CellPlan:
        flags: list[str] = []
        if not cell.cuda_graph:
            flags.append("--disable-cuda-graph")
        if cell.speculative:
            flags += ["--speculative-algorithm", self.speculative_algorithm, *self.speculative_args]
        if cell.deepep:
            flags += ["--moe-a2a-backend", "deepep", "--deepep-mode", self.deepep_mode]
        else:
            flags += ["--moe-a2a-backend", "none"]
        return CellPlan(cell, self.name, True, engine_flags=tuple(flags), trainer_flags=trainer_flags(cell))


@dataclasses.dataclass(frozen=True)
class HFToggles:
    """The `hf` engine's equivalents (transformers `generate`).

    cuda_graph: static KV cache (`cache_implementation="static"`); on CUDA transformers then compiles the
      decode step itself (torch.compile, mode reduce-overhead: CUDA-graph capture and replay); off: dynamic
      cache, eager decode (`disable_compile=True`).
    speculative: assisted generation by prompt lookup (`prompt_lookup_num_tokens`); transformers runs it at
      batch size 1 only, so the cell generates one sequence at a time.
    deepep: not applicable (no MoE all-to-all in this engine); deepep=off cells run, deepep=on cells are n/a.
    """

    prompt_lookup_num_tokens: int = 3
    name: str = "hf"

    def supports(self, toggle: str) -> bool:
        return toggle in ("cuda_graph", "speculative")

    def meaning(self, toggle: str) -> str:
        return {
            "cuda_graph": 'on: cache_implementation="static" (decode step compiled + CUDA-graph replayed on '
            "CUDA); off: dynamic cache, eager decode",
            "speculative": f"on: prompt-lookup assisted generation (prompt_lookup_num_tokens="
            f"{self.prompt_lookup_num_tokens}, batch size 1); off: plain sampling",
            "deepep": "n/a: the hf engine has no MoE all-to-all",
        }[toggle]

    def plan(self, cell: Cell) -> CellPlan:
        if cell.deepep:
            return CellPlan(
                cell, self.name, False, reason="deepep=on: the hf engine has no DeepEP / MoE all-to-all (toggle n/a)"
            )
        kwargs: dict[str, Any] = {}
        overrides: dict[str, Any] = {}
        notes: list[str] = []
        if cell.cuda_graph:
            kwargs["cache_implementation"] = "static"
            notes.append(
                "transformers compiles the static-cache decode step on CUDA only (on CPU: static cache, no graph)"
            )
        else:
            kwargs["cache_implementation"] = "dynamic"
            kwargs["disable_compile"] = True
        if cell.speculative:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
            overrides["max_batch_size"] = 1
            if cell.cuda_graph:
                # Verification writes up to `prompt_lookup_num_tokens` draft positions past the current length:
                # the static cache needs that headroom (else index_copy_ runs past its end). The repro sets
                # max_cache_len from the prompt width.
                kwargs["max_cache_len"] = "auto"
        return CellPlan(cell, self.name, True, generate_kwargs=kwargs, rollout_overrides=overrides, notes=tuple(notes))


def backend_toggles(backend: str, **options) -> SGLangToggles | HFToggles:
    if backend == "hf":
        return HFToggles(**options)
    if backend == "sglang":
        return SGLangToggles(**options)
    raise ValueError(f"backend {backend!r}: expected 'hf' or 'sglang'")


def toggle_support_table(backend: str) -> list[dict[str, str]]:
    mapping = backend_toggles(backend)
    return [
        {"toggle": t, "applicable": "yes" if mapping.supports(t) else "n/a", "meaning": mapping.meaning(t)}
        for t in TOGGLES
    ]
