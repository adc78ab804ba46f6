"""Offline HF model directories for tests: a character-level `tokenizers` tokenizer with a chat
template (saved as an ordinary HF tokenizer) next to a tiny random Llama / Qwen2 / Qwen3 model."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = [c for c in string.printable if c not in "\x0b\x0c"]
# Every turn opens with the bos token: a prompt encoded with add_special_tokens=True on top of the
# rendered template would start with two of them.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s><|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s><|assistant|>{% endif %}"
)


def build_tokenizer(chat_template: bool = True):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model_dir(
    path: str | Path,
    *,
    arch: str = "llama",
    chat_template: bool = True,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
) -> Path:
    import torch
    import transformers

    path = Path(path)
    tok = build_tokenizer(chat_template)
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, name) for name in classes[arch])
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CORPUS = [
    "Ana has 12 apples. Ben gives Ana 5 more apples. How many apples does Ana have now?",
    "There are 7 books in a box and 3 books on the table, so there are 10 books in total.",
    "The answer is 42. First we add the numbers, then we check the result.",
    "Each child has 4 marbles, and there are 6 children, so they have 24 marbles together.",
] * 8


def build_bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained here on a tiny corpus (merges make tokenization non-trivial)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
