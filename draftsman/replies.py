"""A chat reply's text as OpenAI's assistant message: the thought apart as `reasoning_content`
(draftsman/reasoning.py), then the answer's tool calls as `tool_calls` (draftsman/tool_calls.py).
One shaping for `draftsman serve`, `Decoder.chat(..., tool_call_parser=, reasoning_parser=)` and
`draftsman generate --chat`, whole replies and streamed ones alike.

It reads the output only: the reply is the target's own, and nothing of it is dropped.
"""
from __future__ import annotations

import dataclasses
import sys

from .reasoning import KEPT_IN_TEXT as REASONING_KEPT
from .reasoning import TAGS as REASONING_TAGS
from .reasoning import ReasoningStream, prompt_ends_thought, prompt_opens_thought, split_reasoning
from .tool_calls import KEPT_IN_TEXT as TOOL_CALL_KEPT
from .tool_calls import TAGS, parse_tool_calls, tool_call_stream
from .verifier.structured import StructuredOutput

PARSER_FLAGS = ("--tool-call-parser", "--reasoning-parser")  # the command line's names for the two settings
# Tokens a format's replies are told apart by, which the target's tokenizer must hold: a model whose
# tokenizer lacks them does not write that format (vLLM's Mistral parsers refuse such a tokenizer too).
# [ARGS] and [CALL_ID] are left out: they came with later tokenizer versions, and the calls read without them.
TOOL_CALL_TOKENS = {"mistral": ("[TOOL_CALLS]",)}
REASONING_TOKENS = {"mistral": ("[THINK]", "[/THINK]")}


def check_parser(name: str, parser: str | None, tags_of: dict[str, tuple[str, ...]], tokenizer) -> str | None:
    """A tool-call or reasoning parser: a known format (tags_of: each format's tags), whose tags
    the target's decoded text keeps. name: how the caller spells the setting, for the message."""
    if parser is None:
        return None
    if parser not in tags_of:
        raise ValueError(f"{name} {parser!r} is not known; the parsers are: {', '.join(tags_of)}")
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    if special & set(tags_of[parser]):
        raise ValueError(f"the target's tokenizer marks {' / '.join(tags_of[parser])} as special tokens, which decoded "
                         f"text drops, so {name} {parser} would never see them: this target does not write that format")
    return parser


def check_parsers(tokenizer, tool_call_parser: str | None, reasoning_parser: str | None,
                  names: tuple[str, str] = ("tool_call_parser=", "reasoning_parser=")) -> None:
    """Both parsers checked against the target's tokenizer (names: how the caller spells them)."""
    if tokenizer is None and (tool_call_parser or reasoning_parser):
        raise ValueError("the target folder has no tokenizer, so its replies have no text to parse: "
                         f"leave out {names[0]} and {names[1]}")
    check_parser(names[0].rstrip("="), tool_call_parser, TAGS, tokenizer)
    check_parser(names[1].rstrip("="), reasoning_parser,
                 {p: () if p in REASONING_KEPT else tags for p, tags in REASONING_TAGS.items()}, tokenizer)
    for name, parser, needed in ((names[0], tool_call_parser, TOOL_CALL_TOKENS),
                                 (names[1], reasoning_parser, REASONING_TOKENS)):
        missing = [tag for tag in needed.get(parser, ()) if not _is_token(tokenizer, tag)]
        if missing:
            raise ValueError(f"the target's tokenizer has no {' / '.join(missing)} token, which replies in the "
                             f"{parser} format are told apart by, so {name.rstrip('=')} {parser} would find nothing "
                             f"in them: this target does not write that format (use a tokenizer that has the "
                             f"token, or leave out {name.rstrip('=')})")


def _is_token(tokenizer, text: str) -> bool:
    """Whether text is one token of the tokenizer (an unknown one comes back as the unknown token)."""
    token = tokenizer.convert_tokens_to_ids(text)
    return token is not None and tokenizer.convert_ids_to_tokens(token) == text


def use_parsers(decoder, tool_call_parser: str | None, reasoning_parser: str | None,
                names: tuple[str, str] = PARSER_FLAGS) -> None:
    """A one-user command's parsers: checked against the decoder's tokenizer, and their markers
    kept in its decoded text from now on (generate --chat, chat; serve keeps them per request)."""
    check_parsers(decoder.tokenizer, tool_call_parser, reasoning_parser, names)
    decoder.keep_in_text(kept_in_text(tool_call_parser, reasoning_parser))


def kept_in_text(tool_call_parser, reasoning_parser) -> tuple[str, ...]:
    """The special tokens the parsers need decoded text to keep (generate's keep_in_text): their
    formats' markers where the tokenizer has them as special tokens (Mistral's)."""
    tool = TOOL_CALL_KEPT.get(tool_call_parser, ()) if isinstance(tool_call_parser, str) else ()
    return tool + REASONING_KEPT.get(reasoning_parser, ())


def with_default_grammar(structured_output, default):
    """A generate call's structured_output with the config's (`default`) for each None in it (one
    grammar, or a list of one per prompt): the grammar each row is held to."""
    if isinstance(structured_output, list):
        return [default if grammar is None else grammar for grammar in structured_output]
    return default if structured_output is None else structured_output


def grammar_after_thought(tokenizer, prompts: list[list[int]], structured_output, reasoning_parser: str | None,
                          forced_call: bool = False):
    """Under a reasoning parser, a chat reply's grammar (structured_output: one for all prompts, or
    a list of one per prompt, None for none) holds the answer only: it begins after the thought's
    "</think>", as vLLM begins it where its reasoning parser sees the thought end, so the model still
    thinks first. Where a prompt's thought has ended already, the grammar holds the reply from the
    first token, as vLLM holds it: the prompt's last marker, read from its end, is "</think>"
    (thinking switched off: the template closed an empty thought), not "<think>" (a template that
    opens the thought, after earlier turns' closed ones). Returns one setting per prompt, one for
    a single prompt (the one given, without a parser or a grammar). "</think>" must be one token,
    or where the model wrote it could not be told from its tokens: such a tokenizer is refused.
    forced_call: the grammar is tool_choice's (draftsman/forced_calls.py), as the refusal names it."""
    per_prompt = isinstance(structured_output, list)
    grammars = structured_output if per_prompt else [structured_output] * len(prompts)
    if reasoning_parser is None or len(grammars) != len(prompts) or all(g is None for g in grammars):
        return structured_output  # (a list of the wrong length is refused by generate, with its count)
    start, end = (_marker(tokenizer, tag) for tag in REASONING_TAGS[reasoning_parser])
    if len(end) != 1:
        raise ValueError(_end_in_pieces(REASONING_TAGS[reasoning_parser][1], len(end), forced_call))
    specs = [None if grammar is None else StructuredOutput.parse(grammar) for grammar in grammars]
    specs = [spec if spec is None or _thought_ended(ids, start, end) else dataclasses.replace(spec, after=end)
             for spec, ids in zip(specs, prompts)]
    return specs if per_prompt or len(specs) > 1 else specs[0]


def _marker(tokenizer, tag: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(tag, add_special_tokens=False))


def _thought_ended(ids: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """Whether the prompt's last thought marker, read from its end, is the thought's end (vLLM's
    is_reasoning_end): a "</think>" in an earlier turn does not end a thought the template opened."""
    ids = list(ids)
    for i in range(len(ids) - 1, -1, -1):
        if tuple(ids[i:i + len(start)]) == start:
            return False
        if tuple(ids[i:i + len(end)]) == end:
            return True
    return False


def _end_in_pieces(end: str, pieces: int, forced_call: bool) -> str:
    """The refusal of a grammar under a reasoning parser whose thought end is several tokens,
    naming what set the grammar: the request's structured output, or its forced tool call."""
    why = (f"under a reasoning parser a grammar begins after {end}, which this tokenizer writes as {pieces} "
           "tokens, so where the thought ends cannot be told from the tokens")
    if forced_call:
        return (f'tool_choice "required" or a named function holds the reply to tool calls by a grammar, but {why}: '
                'leave out the reasoning parser, or send tool_choice "auto" and read the calls the model writes')
    return f"{why}: leave out the reasoning parser or the structured output"


def opened_thoughts(tokenizer, prompts: list[list[int]], rows: int, reasoning_parser: str | None,
                    grammars=None) -> list[bool | None]:
    """Per reply row (prompt by prompt, the same number of rows each), whether it is read as
    starting inside a thought: its chat prompt ends inside one the template opened
    (draftsman/reasoning.py), or its grammar begins after the thought (grammars: the
    structured_output grammar_after_thought gave), so its answer is what follows "</think>",
    where the grammar began. None: the prompt ends the thought (an empty one, thinking switched
    off), so the reply is all answer, streamed or whole. All False without a reasoning parser."""
    if not reasoning_parser or not prompts:
        return [False] * rows
    # The end of a prompt is enough: 16 tokens hold "<think>" and its line even spelled out.
    ends = [tokenizer.decode(list(ids)[-16:]) for ids in prompts]
    opened = [prompt_opens_thought(end, reasoning_parser) for end in ends]
    specs = grammars if isinstance(grammars, list) else [grammars] * len(prompts)
    opened = [None if prompt_ends_thought(end, reasoning_parser) else inside or bool(getattr(spec, "after", ()))
              for inside, spec, end in zip(opened, specs, ends)]
    return [opened[row // (rows // len(prompts))] for row in range(rows)]


def reply_message(text: str, finish_reason: str, tool_call_parser: str | None = None,
                  reasoning_parser: str | None = None, tools: list[dict] | None = None,
                  opened: bool = False, one_call: bool = False) -> tuple[dict, str]:
    """A whole reply -> (OpenAI's assistant message, its finish reason). Under a reasoning parser
    the thought is `reasoning_content` (None when there is none); under a tool-call parser the
    answer's calls are `tool_calls` (left out when there are none), and a reply that ended
    normally ("stop") in calls ends with "tool_calls". tools: the request's tool definitions
    (qwen3_coder reads its values' types from them); opened: the prompt opened the thought, so
    the reply starts inside it (opened_thoughts; None: the prompt ended it, so the reply is all
    answer); one_call: only the first call is kept (OpenAI's
    parallel_tool_calls false, as vLLM keeps it: the calls after it are dropped)."""
    message = {"role": "assistant", "content": text}
    if reasoning_parser and opened is None:  # the prompt ended the thought: all answer (as ReplyStream)
        message["reasoning_content"], message["content"] = None, text or None
    elif reasoning_parser:
        message["reasoning_content"], message["content"] = split_reasoning(text, reasoning_parser, opened)
    if tool_call_parser and message["content"] is not None:
        message["content"], calls = parse_tool_calls(message["content"], tool_call_parser, tools)
        if calls:
            message["tool_calls"] = calls[:1] if one_call else calls
            finish_reason = _finish_in_calls(tool_call_parser, finish_reason)
    return message, finish_reason


def _finish_in_calls(parser, reason: str) -> str:
    """A reply that ended normally ("stop") in calls ends with "tool_calls", unless its parser keeps
    "stop" (a named forced call, as OpenAI answers one: draftsman/forced_calls.py)."""
    return "tool_calls" if reason == "stop" and not getattr(parser, "keeps_stop", False) else reason


def reply_messages(texts: list[str], tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                   tools: list[dict] | None = None, opened: list[bool] | None = None,
                   one_call: bool = False) -> list[dict]:
    """Each reply's assistant message (reply_message's, without the finish reason); opened: per
    reply, as opened_thoughts gives it."""
    opened = opened or [False] * len(texts)
    return [reply_message(text, "stop", tool_call_parser, reasoning_parser, tools, inside, one_call)[0]
            for text, inside in zip(texts, opened)]


class ReplyStream:
    """A streamed reply's pieces -> OpenAI chat deltas ({"reasoning_content"}, {"content"},
    {"tool_calls"}), parsed as reply_message parses the whole reply. Text that may be the start of
    a tag is held until the next piece tells."""

    def __init__(self, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 tools: list[dict] | None = None, opened: bool | None = False, one_call: bool = False):
        # opened None: the prompt ended the thought, so nothing is read as one (reply_message's reading)
        self.thought = ReasoningStream(reasoning_parser, opened) if reasoning_parser and opened is not None else None
        self.parser, self.one_call = tool_call_parser, one_call
        self.calls = tool_call_stream(tool_call_parser, tools) if tool_call_parser else None

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        """The deltas this piece completes; final: the reply ends with it (everything held is sent)."""
        deltas = [{"content": piece}] if piece else []
        if self.thought is not None:
            deltas = self.thought.feed(piece) + (self.thought.finish() if final else [])
        if self.calls is not None:
            deltas = [out for d in deltas for out in (self.calls.feed(d["content"]) if "content" in d else [d])]
            deltas += self.calls.finish() if final else []
            if self.one_call:  # the first call's deltas only (reply_message's one_call)
                deltas = [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        return deltas

    def finish_reason(self, reason: str) -> str:
        """The reply's finish reason once it ended: "tool_calls" when it ended normally in calls."""
        return _finish_in_calls(self.parser, reason) if self.calls is not None and self.calls.calls else reason


def message_deltas(message: dict) -> list[dict]:
    """A whole message as the deltas a stream of it gives: thought, answer, then its calls."""
    deltas = [{key: message[key]} for key in ("reasoning_content", "content") if message.get(key)]
    return deltas + [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls", []))]


class DeltaPrinter:
    """Deltas as terminal text: the thought under a "[reasoning]" line, the answer under an
    "[answer]" line when something came before it, each call on a "[tool call] NAME ARGUMENTS" line.
    White space that opens a part under its header is not printed (a display only: the reply's
    text and message keep it)."""

    def __init__(self, file=None):
        self.file = file or sys.stdout
        self.section = None  # the kind of text printed last
        self.line_open = False  # whether the last text printed did not end its line

    def write(self, deltas: list[dict]) -> None:
        for delta in deltas:
            for call in delta.get("tool_calls", []):
                self._header(f"[tool call] {call['function']['name']} {call['function']['arguments']}")
                self.section = "tool_calls"
            for key in ("reasoning_content", "content"):
                text = delta.get(key) or ""
                if text and key != self.section and (key == "reasoning_content" or self.section is not None):
                    text = text.lstrip()
                    if not text:  # the new part has shown nothing yet: its header waits
                        continue
                    self._header("[reasoning]" if key == "reasoning_content" else "[answer]")
                if text:
                    print(text, end="", file=self.file, flush=True)
                    self.section, self.line_open = key, not text.endswith("\n")

    def end(self) -> None:
        """Close the reply's last line."""
        if self.line_open:
            print(file=self.file, flush=True)
        self.section, self.line_open = None, False

    def _header(self, line: str) -> None:
        if self.line_open:
            print(file=self.file)
        print(line, file=self.file, flush=True)
        self.line_open = False
