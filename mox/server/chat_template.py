"""Chat messages -> prompt text, with the checkpoint's own jinja2 chat template.

The template comes from `chat_template.jinja` in the checkpoint if there is one (GPT-OSS and
GLM-4.5 ship it only there), else from `tokenizer_config.json`'s `chat_template` (a string, or
a list of {name, template} of which "default" is used), as transformers picks it. It runs in
jinja2's immutable sandbox set up as transformers sets it up: trim_blocks, lstrip_blocks,
`break`/`continue`, `{% generation %}` blocks, `tojson` with json.dumps' options,
`raise_exception`, `strftime_now`, the tokenizer's special tokens (`bos_token`, `eos_token`,
`pad_token`, ...) and `add_generation_prompt=True`. A checkpoint without a template serves
completions, and its chat requests are refused (transformers and vLLM refuse them too).
"""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mox.errors import InvalidRequestError
from mox.loaders.json_files import read_json_object
from mox.tokenizer import TOKENIZER_CONFIG_FILE, token_text

CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE_NAME = "default"
# tokenizer_config.json's special tokens, which transformers hands a template
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training
    masks (transformers' AssistantTracker); rendering a prompt, it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplate:
    """A compiled template, or why there is none. A template that does not compile (or is
    missing) is kept with its error, so the model still serves completions and only chat
    requests are refused."""

    def __init__(self, source: str | None, special_tokens: dict[str, object] | None = None,
                 origin: str = "the chat template", error: str | None = None) -> None:
        self.source = source
        self.special_tokens = special_tokens or {}
        self.origin = origin               # the file it came from, for errors
        self._template: jinja2.Template | None = None
        self._error = error or (None if source is not None else
                                "the model has no chat template (no chat_template.jinja and "
                                "no chat_template in tokenizer_config.json); use "
                                "/v1/completions")
        if source is None:
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _Generation])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            self._error = f"the model's chat template ({origin}) is invalid: {e} (line {e.lineno})"
        except jinja2.TemplateError as e:
            self._error = f"the model's chat template ({origin}) is invalid: {e}"

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str) -> ChatTemplate:
        config_path = os.path.join(checkpoint_dir, TOKENIZER_CONFIG_FILE)
        config = read_json_object(config_path) or {}
        specials = _special_tokens(config)
        path = os.path.join(checkpoint_dir, CHAT_TEMPLATE_FILE)
        if os.path.lexists(path) and not os.path.isdir(path):   # (transformers skips a folder)
            try:
                with open(path, encoding="utf-8") as f:
                    return cls(f.read(), specials, path)
            except (OSError, UnicodeDecodeError) as e:
                return cls(None, specials, path, f"cannot read the model's chat template "
                                                 f"{path}: {e}")
        source, error = _select_template(config.get("chat_template"))
        return cls(source, specials, config_path, error and f"{config_path}: {error}")

    def render(self, messages: list[dict[str, str]]) -> str:
        """`messages`: [{"role", "content"}, ...] with text content. Template errors (including
        the template's own `raise_exception`, e.g. roles that do not alternate) are the
        request's fault as far as the client can tell: InvalidRequestError."""
        if self._template is None:
            raise InvalidRequestError(self._error, param="messages")
        try:
            return self._template.render(**self.special_tokens, messages=messages,
                                         add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from e
        except Exception as e:  # noqa: BLE001 - the checkpoint's template failed at run time
            raise InvalidRequestError(f"the model's chat template failed: "
                                      f"{type(e).__name__}: {e}", param="messages") from e


def _select_template(value: str | list | None) -> tuple[str | None, str | None]:
    """(source, None), or (None, why there is none to use)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        source = named.get(DEFAULT_TEMPLATE_NAME)
        if isinstance(source, str):
            return source, None
        return None, (f"chat_template lists templates named {sorted(map(str, named))} but "
                      f"none {DEFAULT_TEMPLATE_NAME!r}")
    return (value, None) if isinstance(value, str) else (None, None)


def _special_tokens(config: dict) -> dict[str, object]:
    """The special tokens' text (older configs store AddedToken dicts), and the additional
    ones as a list, as transformers passes its special-tokens map."""
    tokens: dict[str, object] = {key: text for key in SPECIAL_TOKENS
                                 if (text := token_text(config.get(key))) is not None}
    additional = config.get("additional_special_tokens")
    if isinstance(additional, list):
        tokens["additional_special_tokens"] = [t for t in map(token_text, additional)
                                               if t is not None]
    return tokens
