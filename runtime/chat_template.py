"""The checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

The template is the checkpoint's own Jinja: `chat_template.jinja` beside it, or `chat_template` in
tokenizer_config.json (a string, or a list of named templates of which "default" is used). It is
code from a downloaded file, so it runs in Jinja2's immutable sandbox, with the globals
transformers gives (`raise_exception`, `strftime_now`) and the special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import RuntimeUsageError


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], where: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                     ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise RuntimeUsageError(f"{where}: the chat template does not parse ({e})") from None
        self.special_tokens = special_tokens
        self.where = where

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; a template's own refusal (raise_exception) is a usage error."""
        from jinja2 import TemplateError
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except TemplateError as e:
            raise RuntimeUsageError(f"chat template: {e}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The template shipped with the checkpoint (copied into OUT by kimi-compile), or None."""
    config_file = directory / "tokenizer_config.json"
    config: dict = {}
    if config_file.exists():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise RuntimeUsageError(f"{config_file}: cannot read ({e})") from None
    special = {name: text for name in ("bos_token", "eos_token", "pad_token", "unk_token")
               if (text := _token_text(config.get(name))) is not None}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return ChatTemplate(jinja_file.read_text(), special, str(jinja_file))
    source = config.get("chat_template")
    if isinstance(source, list):                # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special, f"{config_file}: chat_template")
