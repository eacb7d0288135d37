"""Chat templates: a model's own template, rendered as `transformers`' `apply_chat_template`
renders it.

A template is Jinja code that came with a checkpoint, so it runs in Jinja's immutable
sandbox, with the same environment `transformers` builds (`trim_blocks`,
`lstrip_blocks`, loop controls, a `tojson` filter that does not escape HTML,
`raise_exception`, `strftime_now`, namespaces that refuse private attributes, and a
`{% generation %}` block that renders its body). The template sees `messages`,
`add_generation_prompt` and the tokenizer's special tokens (`bos_token`, `eos_token`,
...). The rendered text is encoded without adding special tokens: the template writes
them.

Where a template comes from: `tokenizer_config.json`'s `chat_template` (a string, or a
list of named templates, of which "default" is used), a `chat_template.jinja` file beside
it (as `transformers` saves it now), or a GGUF file's `tokenizer.chat_template`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from pathlib import Path

__all__ = ["ChatTemplate", "check_messages", "encode_chat", "load_chat_template"]

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, where it was found, and the special tokens it may name."""

    template: str
    source: str  # "<file>: <field>", for errors
    special_tokens: tuple[tuple[str, str], ...] = ()

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The text of `messages` (role/content dicts). ValueError naming the template's
        file and field when it fails to compile or render."""
        import jinja2

        check_messages(messages, "messages")
        try:
            compiled = _environment().from_string(self.template)
            return compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **dict(self.special_tokens),
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.source}: the chat template fails: {e}") from None


def encode_chat(tokenizer, template: ChatTemplate, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered by `template` with the generation prompt, encoded by
    `tokenizer` (a `tokenizers.Tokenizer`) without added special tokens."""
    return tokenizer.encode(template.render(messages), add_special_tokens=False).ids


def check_messages(messages, where: str) -> None:
    """A ValueError naming `where` unless `messages` is a non-empty list of objects with a
    string `role` and a string `content`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}] must be an object with role and content")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                raise ValueError(f"{where}[{i}].{field} must be a string")


def load_chat_template(path: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a model directory or .gguf file, or None if it has none."""
    path = Path(path)
    if path.is_file():
        return _from_gguf(path)
    config_file = path / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON ({e})") from None
    special = tuple((k, v) for k, v in ((k, _token(config.get(k))) for k in SPECIAL) if v)
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), str(jinja_file), special)
    template = config.get("chat_template")
    if template is None:
        return None
    source = f"{config_file}: chat_template"
    if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{source} must be a string or hold a template named 'default'")
    return ChatTemplate(template, source, special)


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken
    object ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_gguf(path: Path) -> ChatTemplate | None:
    from jax_specdec.io.gguf_file import field, open_gguf

    reader = open_gguf(path)
    template = field(reader, "tokenizer.chat_template", None)
    if template is None:
        return None
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    ids = {"bos_token": "bos_token_id", "eos_token": "eos_token_id"}
    ids |= {"unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    special = []
    for name, key in ids.items():
        token_id = field(reader, f"tokenizer.ggml.{key}", None)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special.append((name, str(tokens[int(token_id)])))
    return ChatTemplate(str(template), f"{path}: tokenizer.chat_template", tuple(special))


def _environment():
    """Jinja's immutable sandbox with what `transformers` adds to it (cached)."""
    global _ENV
    if _ENV is None:
        _ENV = _make_environment()
    return _ENV


_ENV = None


def _make_environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (assistant-token masks in training
        templates): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A template's namespace, refusing private (underscore) attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_public(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_public(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    return env


def _check_public(name) -> None:
    import jinja2

    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")
