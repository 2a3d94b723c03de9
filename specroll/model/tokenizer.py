"""Tokenizer and chat formatting through transformers (read from the model directory).

Text from a user or a data file is tokenized as text, never as control tokens: a record
whose prompt holds '<|im_end|>\\n<|im_start|>assistant ...' must not open a turn of its
own, so only the chat template's own markers become special tokens. A conversation whose
text holds no special token's string is encoded exactly as transformers encodes it (the
common case: ids unchanged); one that does is rendered with each such string held out by a
placeholder (so the template treats the text as it would), and the result is tokenized
with special tokens matched in the template's text only.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specroll.inputs import regular_entries


class Tokenizer:
    """Thin wrapper: prompt text → ids (chat template applied when the model has one)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        if Path(model_dir).is_dir():  # tokenizers reads in native code: no FIFO may wait
            regular_entries(model_dir, "model directory")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"no usable tokenizer in {model_dir}: {e}") from e
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        added = {t.content: t for t in self.hf.added_tokens_decoder.values() if t.special}
        specials = set(added) | {str(t) for t in self.hf.all_special_tokens}
        self._strip = {k: (t.lstrip, t.rstrip) for k, t in added.items()}
        """Whether each special token eats the whitespace on its left, on its right."""
        # longest first: one special's string may start another's
        ordered = sorted((s for s in specials if s), key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        """Matches the string of any special (control) token."""

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as text: no BOS, and a control token's string stays characters."""
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Ids of a user prompt, wrapped in the chat template (with the assistant header);
        without it (chat=False, or no template) the text with the tokenizer's BOS, its
        control-token strings kept as text."""
        if chat and self.has_chat_template:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.hf.encode(text, add_special_tokens=True, split_special_tokens=True)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Ids of a conversation through the chat template, with the assistant header;
        `template_kwargs` go to the template (enable_thinking=False, ...). Without a
        template, the messages' contents joined by blank lines. Message text is text: only
        the template's own markers become control tokens."""
        if not self.has_chat_template:
            text = "\n\n".join(m["content"] for m in messages)
            return self.hf.encode(text, add_special_tokens=True, split_special_tokens=True)
        if any(self._holds_control(m) for m in messages):
            return self._encode_held(messages, template_kwargs)
        ids = self.hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _holds_control(self, message: dict) -> bool:
        """Whether a message's content holds a control token's string; ValueError when one
        of its other fields does (the template prints those as they are: the role, a
        name, tool calls), since they are no text that can be held out."""
        if self._special is None:
            return False
        for key, value in message.items():
            if key == "content":
                continue
            for s in _strings(value):
                found = self._special.search(s)
                if found:
                    raise ValueError(
                        f"a chat message's {key!r} holds the control token "
                        f"{found.group()!r}; only its 'content' may hold such text"
                    )
        content = message.get("content")
        return any(self._special.search(s) for s in _strings(content))

    def _encode_held(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        """Ids of a conversation whose content holds control-token strings: each is replaced
        by a placeholder the template passes through, the rendered text has the strings put
        back, and it is tokenized with specials matched outside them only."""
        assert self._special is not None
        tag = f"specroll{secrets.token_hex(8)}"
        held: list[str] = []

        def hold(found: re.Match) -> str:
            held.append(found.group())
            return f"{tag}{len(held) - 1}{tag}"

        masked = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": self._special.sub(hold, content)}
            masked.append(m)
        text = self.hf.apply_chat_template(
            masked, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        parts = re.split(f"{tag}(\\d+){tag}", text)
        found_all = {int(i) for i in parts[1::2]} == set(range(len(held)))
        if not found_all or any(tag in part for part in parts[::2]):
            raise ValueError(
                f"a chat message holds the control token {held[0]!r} and the chat template "
                "changes message text, so it cannot be kept as text: remove it from the data"
            )
        texts, marks = [""], []  # text to tokenize as text, between the template's markers
        for k, part in enumerate(parts):
            if k % 2:  # a held string: text
                texts[-1] += held[int(part)]
                continue
            pos = 0
            for found in self._special.finditer(part):  # the template's own markers
                texts[-1] += part[pos : found.start()]
                marks.append(found.group())
                texts.append("")
                pos = found.end()
            texts[-1] += part[pos:]
        return self._tokenize(texts, marks)

    def _tokenize(self, texts: list[str], marks: list[str]) -> list[int]:
        """texts[0], marks[0], texts[1], ...: the texts tokenized as text, the marks as
        control tokens, with the whitespace an lstrip/rstrip special token eats removed
        as the tokenizer would."""
        for j, mark in enumerate(marks):
            lstrip, rstrip = self._strip.get(mark, (False, False))
            if lstrip:
                texts[j] = texts[j].rstrip()
            if rstrip:
                texts[j + 1] = texts[j + 1].lstrip()
        ids = self.encode_text(texts[0]) if texts[0] else []
        for mark, text in zip(marks, texts[1:], strict=True):
            ids.append(self.hf.convert_tokens_to_ids(mark))
            ids += self.encode_text(text) if text else []
        return ids


def _strings(value: Any) -> Iterator[str]:
    """Every string in a message field (nested lists and objects: tool calls)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
