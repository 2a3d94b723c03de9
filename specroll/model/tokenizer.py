"""Tokenizer and chat formatting through transformers (read from the model directory)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """Thin wrapper: prompt text → ids (chat template applied when the model has one)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"no usable tokenizer in {model_dir}: {e}") from e
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Ids of a user prompt, wrapped in the chat template (with the assistant header)."""
        if chat and self.has_chat_template:
            ids = self.hf.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
