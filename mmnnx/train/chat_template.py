"""A checkpoint's chat template, rendered as transformers' ``apply_chat_template`` renders it:
Jinja in a sandbox, with transformers' globals and its ``{% generation %}`` tag."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
import re

ROLES = ("system", "developer", "user", "assistant", "tool")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not parse or fails to render a conversation."""


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The compiled template and the ``[blocks, spans]`` its ``{% generation %}`` tag writes to:
    the output so far and the ``(start, end)`` of each marked text, as transformers records them."""
    import jinja2  # noqa: PLC0415  (only chat data needs it)
    import jinja2.ext  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records where its text lands."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_mark")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            blocks, spans = state
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    state: list = [[], []]
    return env.from_string(source), state


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may read (``bos_token``, ...).

    :meth:`render` gives the text transformers' ``apply_chat_template(tokenize=False)`` gives,
    and the character spans of the assistant's turns: those a ``{% generation %}`` tag marks,
    or, in a template without one (Llama's, Qwen's), each assistant message's text with what
    the template writes after it up to the next turn, found by rendering the conversation up
    to that message with and without it.

    Example:
        >>> t = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        ...                  "{{ eos_token }}{% endfor %}"
        ...                  "{% if add_generation_prompt %}<assistant>{% endif %}",
        ...                  {"eos_token": "</s>"})
        >>> t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
        ('<user>hi</s><assistant>yo</s>', [(23, 29)])
    """

    source: str
    tokens: dict = dataclasses.field(default_factory=dict)
    origin: str = "the chat template"

    @classmethod
    def from_checkpoint(cls, folder: str | pathlib.Path) -> ChatTemplate:
        """The template a checkpoint's tokenizer carries: ``chat_template.jinja`` (as
        transformers 5 saves it), else the ``chat_template`` key of ``tokenizer_config.json``
        (a string, or a list of named templates of which ``default`` is taken).

        Raises:
            ChatTemplateError: the folder has neither, naming it.

        Example:
            >>> import tempfile
            >>> d = pathlib.Path(tempfile.mkdtemp())
            >>> _ = (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
            >>> ChatTemplate.from_checkpoint(d).render([{"role": "user", "content": "x"}])[0]
            'x'
        """
        folder = pathlib.Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = _tokenizer_config(folder)
        tokens = _special_tokens(config)
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), tokens, str(jinja))
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"{folder}: the tokenizer has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json): add a chat_template.jinja"
            )
        return cls(source, tokens, f"{config_path} (chat_template)")

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the ``(start, end)`` character spans of its assistant
        turns.

        Raises:
            ChatTemplateError: the template does not parse or raises on these messages,
                naming the template's file and Jinja's message.
        """
        text, marked = self._render(messages, add_generation_prompt)
        if _GENERATION_TAG.search(self.source):
            return text, marked
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, _ = self._render(messages[:i], True)
            upto, _ = self._render(messages[: i + 1], False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ChatTemplateError(
                    f"{self.origin}: the text of the conversation up to message {i} is not a "
                    "prefix of the whole conversation's (the template rewrites earlier turns), "
                    "so the assistant's tokens cannot be told apart; use a template with "
                    "{% generation %} tags or --train-on all"
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation's text alone (:meth:`render` without the assistant's spans)."""
        return self._render(messages, add_generation_prompt)[0]

    def _render(self, messages: list[dict], add_generation_prompt: bool):
        import jinja2  # noqa: PLC0415

        try:
            template, state = _compile(self.source)
            state[:] = [], []
            blocks, spans = state
            for block in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.tokens
            ):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.origin}: {type(e).__name__}: {e}") from None
        return "".join(blocks), list(spans)


def special_tokens(folder: str | pathlib.Path) -> dict[str, str]:
    """The special tokens (``bos_token``, ``eos_token``, ...) a checkpoint's
    ``tokenizer_config.json`` names, as text (transformers passes them to the template).

    Example:
        >>> special_tokens("/nonexistent")
        {}
    """
    return _special_tokens(_tokenizer_config(folder))


def _tokenizer_config(folder: str | pathlib.Path) -> dict:
    path = pathlib.Path(folder) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _special_tokens(config: dict) -> dict[str, str]:
    tokens = {k: config[k] for k in SPECIAL_TOKENS if config.get(k) is not None}
    return {k: t["content"] if isinstance(t, dict) else str(t) for k, t in tokens.items()}
