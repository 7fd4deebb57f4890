"""Chat messages to one prompt text, through the model folder's chat template when it has one.

The template is ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named
templates of which ``default`` is taken) or a ``chat_template.jinja`` file, rendered in
jinja2's sandbox with ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``, as Hugging Face renders it. A folder without one gets ``FALLBACK_TEMPLATE``:
each message as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` to prompt the answer.
The text is then tokenized without the tokenizer's own special tokens (the template places them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FALLBACK_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ChatTemplate:
    """A compiled template; ``render`` raises ``ValueError`` when the template itself refuses."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", fallback: bool = False) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the model's chat template does not compile: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.fallback = fallback
        """Whether this is ``FALLBACK_TEMPLATE`` (the folder has no template of its own)."""

    @classmethod
    def from_dir(cls, folder: str | Path) -> ChatTemplate:
        """The template of model folder ``folder``, or the fallback."""
        root = Path(folder)
        settings = _read_json(root / "tokenizer_config.json")
        source = settings.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = root / "chat_template.jinja"
        if not isinstance(source, str) and jinja.is_file():
            source = jinja.read_text(encoding="utf-8")
        bos, eos = _token(settings.get("bos_token")), _token(settings.get("eos_token"))
        if isinstance(source, str):
            return cls(source, bos, eos)
        return cls(FALLBACK_TEMPLATE, bos, eos, fallback=True)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _token(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
