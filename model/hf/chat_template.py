"""A model's chat template: found beside the model, compiled once, rendered as `transformers` renders it.

Where it comes from (transformers 5's order): ``--chat-template FILE`` (an override), else ``chat_template.jinja``
and ``additional_chat_templates/*.jinja`` beside the model (the first is the template named "default"), else
``chat_template.json``'s ``chat_template`` (processors' legacy file), else tokenizer_config.json's ``chat_template``:
a string, or a list of ``{"name", "template"}``. Of named templates, ``name`` picks one; without it "tool_use" is
used when ``tools`` are given (transformers' ``get_chat_template`` rule), else "default".

Rendering mirrors ``transformers.utils.chat_template_utils`` (``_compile_jinja_template`` and
``render_jinja_template``) without importing transformers: an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, loopcontrols and the ``{% generation %}`` tag, its ``tojson`` (ensure_ascii=False), the globals
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing ``namespace``; the tokenizer's special
tokens (``bos_token``, ``eos_token``...) and ``extra`` (chat_template_kwargs) as variables; message keys whose value
is None dropped; ``reasoning_content`` aliased as transformers aliases it; ``continue_final_message`` trimmed at its
tag. What it adds, as vLLM does (vllm/entrypoints/chat_utils.py) for OpenAI-shaped messages: an assistant's
``tool_calls[].function.arguments`` JSON string becomes a dict (templates call ``arguments | tojson`` or iterate
``arguments.items()``; invalid JSON or a non-object becomes ``{}``), and a ``content`` list of text parts becomes one
string (joined with "\\n") unless the template loops over ``message['content']`` itself (vLLM's "openai" content
format).

The rendered text holds the template's control tokens as text: model.hf.chat_prompt.PromptEncoder turns a chat into
ids, the tokens the template writes as their ids and the same tokens inside user strings as text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.hf.common import HFImportError, read_bytes, read_json
from model.hf.tokenizer import MAX_TOKEN_FILE_BYTES, TOKEN_FILES

logger = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # <name>.jinja: named templates beside the default one
LEGACY_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": ...}
TOKENIZER_CONFIG = TOKEN_FILES[0]  # tokenizer_config.json
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB to ~20 KB
MAX_NAMED_TEMPLATES = 16
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a template sees as variables
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Markers that end a turn, as templates write them (ChatML/Qwen, Llama 3 and 3.1, Gemma, Phi-3, Cohere, Granite,
# GPT-2, DeepSeek, Llama 2 / Mistral written literally)
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|END_OF_TURN_TOKEN|>",
                       "<|end_of_text|>", "<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>")
HERMES_TOOL_CALL = ("<tool_call>", "</tool_call>")
THINK = ("<think>", "</think>")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker after the message to continue
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names; the first is the standard
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")  # variables ``extra`` cannot set


class ChatTemplateError(ValueError):
    """A chat template cannot be loaded or rendered; the message is fit for the API's user."""


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %} ... {% endgeneration %}`` (its AssistantTracker): renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """The template's ``dict``: calls and ``fromkeys`` only (no attribute access to the builtin type)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore-prefixed attributes (transformers' TemplateNamespace)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """One compiled chat template with the special tokens it renders with (compiled at construction:
    ChatTemplateError naming ``origin`` for bad syntax)."""

    source: str  # the jinja text
    origin: str  # where it came from: a file name beside the model, or the override's path
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the variables the template sees
    tool_use: ChatTemplate | None = None  # the named "tool_use" template, rendered instead when tools are given
    # tokenizer_config.json's chat_control_tokens: the non-special added tokens user text may not write (None:
    # those the template's text holds, transformers' default); special tokens always count
    control_tokens: tuple[str, ...] | None = None
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)
    _literals: str = field(init=False, repr=False, compare=False)  # the template's text and string constants
    _loops_over_content: bool = field(init=False, repr=False, compare=False)
    _uses_eos: bool = field(init=False, repr=False, compare=False)  # writes the eos_token variable

    def __post_init__(self) -> None:
        env = _environment()
        try:
            tree = env.parse(self.source)
            compiled = env.from_string(tree)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{self.origin}: the chat template is not valid jinja (line {exc.lineno}: "
                                    f"{exc.message})") from None
        except (jinja2.exceptions.TemplateError, RecursionError) as exc:
            raise ChatTemplateError(f"{self.origin}: the chat template is not valid jinja ({exc})") from None
        literals = [n.data for n in tree.find_all(jinja2.nodes.TemplateData)]
        literals += [n.value for n in tree.find_all(jinja2.nodes.Const) if isinstance(n.value, str)]
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_literals", "\0".join(literals))
        object.__setattr__(self, "_loops_over_content", _loops_over_content(tree))
        object.__setattr__(self, "_uses_eos", "eos_token" in _names(tree))

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               extra: dict | None = None, mark: Callable[[Any], Any] | None = None) -> str:
        """The prompt text of ``messages`` (OpenAI-shaped dicts, not modified), as transformers'
        ``apply_chat_template(messages, tools=..., documents=..., add_generation_prompt=...,
        continue_final_message=..., tokenize=False, **extra)`` renders it (see the module docstring for the vLLM
        conversions); ChatTemplateError for what the template refuses (raise_exception's message) or fails on.
        ``mark`` rewrites the caller's data (messages, tools, documents, extra) first: PromptEncoder's marks."""
        return self.variant(tools)._render(messages, tools, documents, add_generation_prompt, continue_final_message,
                                           extra, mark)

    def variant(self, tools: list[dict] | None) -> ChatTemplate:
        """The template that renders a request with ``tools``: the named "tool_use" one where there is one and
        tools are given (even an empty list, as transformers has it), else this one."""
        return self.tool_use if tools is not None and self.tool_use is not None else self

    def _render(self, messages: list[dict], tools: list[dict] | None, documents: list[dict] | None,
                add_generation_prompt: bool, continue_final_message: bool, extra: dict | None,
                mark: Callable[[Any], Any] | None) -> str:
        """``render`` by this template (not a variant)."""
        if not messages:
            raise ChatTemplateError("messages: the conversation is empty")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        reserved = sorted(set(extra or ()) & set(RESERVED))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {reserved[0]!r} cannot be set there")
        mark = mark or (lambda value: value)
        try:
            chat = [_alias_reasoning(m) for m in mark([self._message(m) for m in _plain(messages, "messages")])]
            variables = {"tools": mark(_plain(tools, "tools")), "documents": mark(_plain(documents, "documents")),
                         **self.special_tokens, **mark(_plain(extra or {}, "chat_template_kwargs"))}
        except RecursionError:
            raise ChatTemplateError("messages, tools, documents or chat_template_kwargs: nested too deeply") from None
        final = self._mark_final(chat) if continue_final_message else None
        try:
            text = self._compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined names, the sandbox
            raise ChatTemplateError(f"the chat template refused the request: {exc}") from None
        except Exception as exc:  # anything else a template expression raises (a TypeError, a KeyError...)
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return _trim_continued(text, final) if final is not None else text

    @property
    def end_of_turn_tokens(self) -> tuple[str, ...]:
        """The known end-of-turn markers the template writes, and its eos_token where it writes that variable
        (Mistral's and Llama 2's ``content + eos_token``), in END_OF_TURN_MARKERS order then the eos."""
        tokens = [t for t in END_OF_TURN_MARKERS if t in self._all_literals()]
        eos = self.special_tokens.get("eos_token")
        if eos and eos not in tokens and any(t._uses_eos for t in self.variants()):
            tokens.append(eos)
        return tuple(tokens)

    @property
    def tool_call_format(self) -> str | None:
        """"hermes" where the template writes ``<tool_call> ... </tool_call>`` (Qwen2.5, Qwen3, Hermes, SmolLM3),
        else None (another format, or no tools)."""
        return "hermes" if all(t in self._all_literals() for t in HERMES_TOOL_CALL) else None

    @property
    def reasoning(self) -> bool:
        """Whether the template knows ``<think> ... </think>`` (Qwen3's reasoning)."""
        return all(t in self._all_literals() for t in THINK)

    def variants(self) -> Iterator[ChatTemplate]:
        """This template, then its "tool_use" one where it has one."""
        yield self
        if self.tool_use is not None:
            yield self.tool_use

    def writes(self, text: str) -> bool:
        """Whether this template's own text or string constants (not its variant's) hold ``text``."""
        return text in self._literals

    def _all_literals(self) -> str:
        return "\0".join(t._literals for t in self.variants())

    def _message(self, message: dict) -> dict:
        """``message`` as templates expect it: None values dropped, text parts joined (unless the template reads
        parts), tool call arguments as dicts."""
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list) and not self._loops_over_content:
            message["content"] = "\n".join(part["text"] for part in content
                                           if isinstance(part, dict) and isinstance(part.get("text"), str))
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            if message["tool_calls"]:
                message["tool_calls"] = [_with_dict_arguments(call) for call in message["tool_calls"]]
            else:
                del message["tool_calls"]  # vLLM: an empty list keeps the template on its plain path
        return message

    def _mark_final(self, chat: list[dict]) -> str:
        """Append transformers' tag to the final message's content (its last text part); the text it ends with."""
        final = chat[-1].get("content")
        if final is None:
            raise ChatTemplateError('continue_final_message: the final message has no "content" to continue')
        if "content" not in self.source:
            raise ChatTemplateError('continue_final_message: the chat template does not read "content"')
        if isinstance(final, list):
            for part in reversed(final):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    text, part["text"] = part["text"], part["text"] + CONTINUE_TAG
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message: the final message's content must be text")
        chat[-1]["content"] = final + CONTINUE_TAG
        return final


def template_files(directory: Path) -> tuple[str, ...]:
    """The files ``load_chat_template`` looks at in ``directory``, in order (for a "no chat template" message)."""
    return TEMPLATE_FILE, f"{TEMPLATE_DIR}/*.jinja", LEGACY_TEMPLATE_FILE, TOKENIZER_CONFIG


def load_chat_template(directory: Path | None, override: Path | None = None, name: str | None = None
                       ) -> ChatTemplate | None:
    """The chat template of the model in ``directory`` (its Hugging Face files; see the module docstring for where it
    is looked for), or of ``override`` (a jinja file) when given, rendered with the special tokens of ``directory``'s
    tokenizer files (none: a model without them); ``name`` picks one of named templates. None where there is none;
    ChatTemplateError naming the file for an unreadable or invalid one."""
    specials, control = _token_settings(directory) if directory is not None else ({}, None)
    if override is not None:
        return ChatTemplate(_read_text(override, str(override)), str(override), specials, None, control)
    if directory is None:
        return None
    templates, origin = _templates(directory)
    if not templates:
        return None
    if isinstance(templates, str):
        if name is not None:
            raise ChatTemplateError(f"{origin}: no chat template named {name!r} (the model has one, unnamed)")
        return ChatTemplate(templates, origin, specials, None, control)
    chosen = name or "default"
    if chosen not in templates:
        raise ChatTemplateError(f"{origin}: no chat template named {chosen!r} (named: {sorted(templates)})")
    tool_use = None
    if name is None and "tool_use" in templates:
        tool_use = ChatTemplate(templates["tool_use"], f"{origin} (tool_use)", specials, None, control)
    return ChatTemplate(templates[chosen], f"{origin} ({chosen})", specials, tool_use, control)


def _token_settings(directory: Path) -> tuple[dict[str, str], tuple[str, ...] | None]:
    """The named special tokens of special_tokens_map.json and tokenizer_config.json (whose entries win): their text,
    an AddedToken's ``content``; and tokenizer_config.json's chat_control_tokens."""
    named: dict[str, Any] = {}
    for file in reversed(TOKEN_FILES):
        path = directory / file
        if path.is_file():
            named |= {k: v for k, v in _read_json(path, MAX_TOKEN_FILE_BYTES).items()
                      if k in (*SPECIAL_TOKEN_NAMES, "chat_control_tokens")}
    tokens = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = named.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str):
            tokens[key] = text
    control = named.get("chat_control_tokens")
    if control is not None and not (isinstance(control, list) and all(isinstance(t, str) for t in control)):
        raise ChatTemplateError(f"{TOKENIZER_CONFIG}: chat_control_tokens must be a list of strings")
    return tokens, None if control is None else tuple(control)


def _templates(directory: Path) -> tuple[str | dict[str, str] | None, str]:
    """The template text, or the named templates, and the file they came from (transformers 5's precedence)."""
    named = {}
    if (directory / TEMPLATE_FILE).is_file():
        named["default"] = _read_text(directory / TEMPLATE_FILE, TEMPLATE_FILE)
    extra = sorted((directory / TEMPLATE_DIR).glob("*.jinja")) if (directory / TEMPLATE_DIR).is_dir() else []
    if len(extra) > MAX_NAMED_TEMPLATES:
        raise ChatTemplateError(f"{TEMPLATE_DIR}: more than {MAX_NAMED_TEMPLATES} templates")
    for path in extra:
        named[path.name.removesuffix(".jinja")] = _read_text(path, f"{TEMPLATE_DIR}/{path.name}")
    if named:
        origin = TEMPLATE_FILE if "default" in named else TEMPLATE_DIR
        return (named["default"] if list(named) == ["default"] else named), origin
    for file in (LEGACY_TEMPLATE_FILE, TOKENIZER_CONFIG):
        if (directory / file).is_file():
            value = _read_json(directory / file, MAX_TOKEN_FILE_BYTES).get("chat_template")
            if value is not None:
                return _checked(value, file), file
    return None, ""


def _checked(value: Any, origin: str) -> str | dict[str, str]:
    """``chat_template`` as a file gives it: a string, or a list of {"name", "template"} as a dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and 0 < len(value) <= MAX_NAMED_TEMPLATES and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(f"{origin}: chat_template must be a string or a list of "
                            f'{{"name", "template"}} (at most {MAX_NAMED_TEMPLATES})')


def _read_text(path: Path, origin: str) -> str:
    try:
        return read_bytes(path, MAX_TEMPLATE_BYTES).decode("utf-8")
    except HFImportError as exc:
        raise ChatTemplateError(f"{origin}: {str(exc).removeprefix(path.name + ': ')}") from None
    except UnicodeDecodeError:
        raise ChatTemplateError(f"{origin}: not UTF-8 text") from None


def _read_json(path: Path, limit: int) -> dict:
    try:
        return read_json(path, limit)
    except HFImportError as exc:
        raise ChatTemplateError(str(exc)) from None


def _plain(value: Any, what: str) -> Any:
    """A copy of ``value`` made of JSON types only (what the sandbox may safely see); ChatTemplateError naming
    ``what`` for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, what) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, what) for v in value]
    raise ChatTemplateError(f"{what}: a {type(value).__name__} is not a JSON value")


def _with_dict_arguments(call: Any) -> Any:
    """An OpenAI tool call with ``function.arguments`` as a dict (vLLM: {} for empty, invalid or non-object JSON)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except (ValueError, RecursionError):
            logger.warning("tool call %r: arguments are not valid JSON; rendered as {}", call["function"].get("name"))
            arguments = {}
    return {**call, "function": {**call["function"], "arguments": arguments if isinstance(arguments, dict) else {}}}


def _alias_reasoning(message: dict) -> dict:
    """transformers' aliases of a message's reasoning: ``thinking`` (gpt-oss) and ``reasoning_content``."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _trim_continued(text: str, final: str) -> str:
    """transformers' continue_final_message cut: the text up to the tag (rstripped where the template trimmed the
    message)."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message as "
                                "given, so it cannot be continued")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _names(tree: jinja2.nodes.Template) -> set[str]:
    return {n.name for n in tree.find_all(jinja2.nodes.Name) if n.ctx == "load"}


def _content_access(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    """Whether ``node`` is ``x['content']`` / ``x.content`` (through filters and tests) or an alias of one."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return node.name in aliases
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
        and node.arg.value == "content"


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Whether the template iterates a message's content itself (vLLM's "openai" content format): a ``for`` over
    ``message['content']``, or over a name set from it."""
    aliases = {n.target.name for n in tree.find_all(jinja2.nodes.Assign)
               if isinstance(n.target, jinja2.nodes.Name) and _content_access(n.node, set())}
    return any(_content_access(n.iter, aliases) for n in tree.find_all(jinja2.nodes.For))
