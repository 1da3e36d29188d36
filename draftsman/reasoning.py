"""A reasoning model's thinking, returned apart from its answer as vLLM returns it
(`message.reasoning_content`, streamed as `delta.reasoning_content`), for
`draftsman serve --reasoning-parser qwen3|deepseek_r1|mistral` (vLLM's flag and parser names).

Qwen3 and DeepSeek-R1 think between <think> and </think> before they answer:
- `qwen3` writes both tags itself. A reply without a closed thought (thinking switched off, or
  cut off inside it) is all answer, as vLLM's qwen3 parser reads it.
- `deepseek_r1`'s chat template opens <think> in the prompt, so a reply starts inside the
  thought (a <think> it writes anyway is dropped) and everything before </think> is reasoning;
  a reply cut off inside the thought is all reasoning.
- Under either parser, a reply to a prompt that ends in <think> (`opened`: the template opened
  the thought, as Qwen3-Thinking-2507's does) starts inside the thought, as deepseek_r1's does.
  The prompt says so before the first token, so a stream needs to hold nothing to know it.
- A reply to a prompt that ends in </think> (`opened` None: the template closed an empty
  thought, thinking switched off) is all answer, streamed or whole, a <think> in it too.
- `mistral`: Magistral's [THINK] ... [/THINK], read as qwen3's, except that a thought opened
  and not closed is reasoning (cut off while thinking): the tags are special tokens, which no
  answer writes by chance. Decoded text drops special tokens, so under this parser it keeps
  these two in the replies it reads (KEPT_IN_TEXT, generate's keep_in_text).

The split reads the output only; the reply is the target's own. Long thoughts are where
speculative decoding pays most: every token of them is drafted and verified as the answer's are.
"""
from __future__ import annotations

from .tool_calls import tag_start_at_end

PARSERS = ("qwen3", "deepseek_r1", "mistral")
START, END = "<think>", "</think>"
TAGS = {"qwen3": (START, END), "deepseek_r1": (START, END), "mistral": ("[THINK]", "[/THINK]")}
# Formats whose tags are special tokens, which their replies keep in decoded text (generate's keep_in_text).
KEPT_IN_TEXT = {"mistral": TAGS["mistral"]}


def prompt_opens_thought(prompt_text: str, parser: str = "qwen3") -> bool:
    """Whether a prompt (its end is enough) leaves the reply inside an opened thought."""
    return prompt_text.rstrip().endswith(TAGS[parser][0])


def prompt_ends_thought(prompt_text: str, parser: str = "qwen3") -> bool:
    """Whether a prompt (its end is enough) closed the thought already, so the reply is all answer:
    a template with thinking switched off writes an empty <think></think> (vLLM's stream then
    sends everything as content). Only the prompt's end counts: an earlier turn's closed thought,
    which a tool loop's prompt keeps, does not stop the new reply from thinking."""
    return prompt_text.rstrip().endswith(TAGS[parser][1])


def split_reasoning(text: str, parser: str, opened: bool = False) -> tuple[str | None, str | None]:
    """A whole reply -> (its reasoning, its answer); None for an empty part. opened: the prompt
    opened the thought (prompt_opens_thought), so the reply starts inside it."""
    start, end = TAGS[parser]
    if parser != "deepseek_r1" and not opened:  # the reply writes the opening tag itself
        if start not in text:
            return None, text or None  # no thought: all answer
        before, after = text.split(start, 1)
        if end not in after:  # qwen3: no closed thought, all answer; mistral: cut off while thinking
            return (None, text or None) if parser == "qwen3" else (after or None, before or None)
        reasoning, answer = after.split(end, 1)
        return reasoning or None, (before + answer) or None
    body = text.split(start, 1)[1] if text.startswith(start) else text
    if end not in body:
        return body or None, None  # cut off while thinking
    reasoning, answer = body.split(end, 1)
    return reasoning or None, answer or None


class ReasoningStream:
    """A streamed reply's pieces -> deltas: {"reasoning_content": ...} while the model thinks,
    {"content": ...} after, text that may be a tag held until it is or cannot be one.

    A qwen3 reply's thought is known to be one only when it closes; until then its text is sent
    as reasoning (vLLM's qwen3 stream does the same), so a reply that opens <think> and never
    closes it streams as reasoning where the whole reply reads as answer."""

    def __init__(self, parser: str, opened: bool = False):
        self.start, self.end = TAGS[parser]
        self.inside_from_start = parser == "deepseek_r1" or opened  # else the reply starts before the thought
        self.held = ""
        self.state = "thinking" if self.inside_from_start else "before"
        self.started = False  # whether any text came yet (a leading <think> is dropped when inside)

    def feed(self, piece: str) -> list[dict]:
        self.held += piece
        deltas: list[dict] = []
        while self.held:
            if self.state == "answer":
                deltas += _delta("content", self.held)
                self.held = ""
                break
            tag = self.end if self.state == "thinking" else self.start
            if self.inside_from_start and not self.started:
                if self.start.startswith(self.held):  # a leading <think>, perhaps not yet whole
                    if self.held == self.start:
                        self.held, self.started = "", True
                    break
                if self.held.startswith(self.start):
                    self.held = self.held[len(self.start):]
                self.started = True
            if tag in self.held:
                before, self.held = self.held.split(tag, 1)
                deltas += _delta("reasoning_content" if self.state == "thinking" else "content", before)
                self.state = "thinking" if self.state == "before" else "answer"
                continue
            keep = tag_start_at_end(self.held, tag)
            sent, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
            deltas += _delta("reasoning_content" if self.state == "thinking" else "content", sent)
            break
        return deltas

    def finish(self) -> list[dict]:
        held, self.held = self.held, ""
        return _delta("reasoning_content" if self.state == "thinking" else "content", held)


def _delta(key: str, text: str) -> list[dict]:
    return [{key: text}] if text else []
