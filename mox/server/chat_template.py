"""Chat messages -> prompt text, with the checkpoint's own jinja2 chat template.

The template comes from `tokenizer_config.json` (`chat_template`: a string, or a list of
{name, template} of which "default" is used) and runs in jinja2's immutable sandbox, as
transformers renders it: trim_blocks, lstrip_blocks, `raise_exception`, `bos_token`,
`eos_token`, `add_generation_prompt=True`. Without one, ChatML.
"""

from __future__ import annotations

import datetime
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mox.errors import InvalidRequestError
from mox.loaders.json_files import read_json_object
from mox.tokenizer import TOKENIZER_CONFIG_FILE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_TEMPLATE_NAME = "default"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled template. A template that does not compile is kept with its error, so the
    model still serves completions and only chat requests are refused."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)
        self._template: jinja2.Template | None = None
        self._compile_error: str | None = None
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            self._compile_error = str(e)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str) -> ChatTemplate:
        config = read_json_object(os.path.join(checkpoint_dir, TOKENIZER_CONFIG_FILE)) or {}
        return cls(_select_template(config.get("chat_template")) or CHATML_TEMPLATE,
                   _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, str]]) -> str:
        """`messages`: [{"role", "content"}, ...] with text content. Template errors (including
        the template's own `raise_exception`, e.g. roles that do not alternate) are the
        request's fault as far as the client can tell: InvalidRequestError."""
        if self._template is None:
            raise InvalidRequestError(f"the model's chat template is invalid: "
                                      f"{self._compile_error}")
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token,
                                         eos_token=self.eos_token, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
        except Exception as e:  # noqa: BLE001 - the checkpoint's template failed at run time
            raise InvalidRequestError(f"the model's chat template failed: "
                                      f"{type(e).__name__}: {e}", param="messages") from e


def _select_template(value: str | list | None) -> str | None:
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get(DEFAULT_TEMPLATE_NAME) or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _token_text(token: str | dict | None) -> str:
    if isinstance(token, dict):        # older configs store AddedToken dicts
        token = token.get("content")
    return token if isinstance(token, str) else ""


