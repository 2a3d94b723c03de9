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
            return self.encode_chat([{"role": "user", "content": text}])
        return self.hf.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Ids of a conversation through the chat template, with the assistant header;
        `template_kwargs` go to the template (enable_thinking=False, ...). Without a
        template, the messages' contents joined by blank lines."""
        if not self.has_chat_template:
            text = "\n\n".join(m["content"] for m in messages)
            return self.hf.encode(text, add_special_tokens=True)
        ids = self.hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
