"""A tiny randomly initialised policy with a character tokenizer, built locally.

The `tiny` preset runs the whole RL pipeline in seconds without downloading anything:
a 4-layer Llama (width 64) whose vocabulary is printable ASCII plus the chat markers,
with a ChatML template, saved as an ordinary HF directory (config.json, safetensors,
tokenizer.json) so every code path treats it like a real model.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny model + tokenizer into `out` (deterministic for a seed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specroll.model.config import ModelConfig
    from specroll.model.transformer import Transformer
    from specroll.model.weights import save_model

    out = Path(out)
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {c: i for i, c in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    hf.chat_template = CHAT_TEMPLATE
    cfg = ModelConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
        eos_token_id=[vocab["<|im_end|>"]],
    )
    model = Transformer(cfg).init_weights(seed=seed, std=0.08)
    save_model(model, out)
    hf.save_pretrained(str(out))
    return out
