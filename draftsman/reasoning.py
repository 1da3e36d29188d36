"""A reasoning model's thinking, returned apart from its answer as vLLM returns it
(`message.reasoning_content`, streamed as `delta.reasoning_content`), for
`draftsman serve --reasoning-parser qwen3|deepseek_r1` (vLLM's flag and parser names).

Both models think between <think> and </think> before they answer:
- `qwen3` writes both tags itself. A reply without a closed thought (thinking switched off, or
  cut off inside it) is all answer, as vLLM's qwen3 parser reads it.
- `deepseek_r1`'s chat template opens <think> in the prompt, so a reply starts inside the
  thought (a <think> it writes anyway is dropped) and everything before </think> is reasoning;
  a reply cut off inside the thought is all reasoning.
- Under either parser, a reply to a prompt that ends in <think> (`opened`: the template opened
  the thought, as Qwen3-Thinking-2507's does) starts inside the thought, as deepseek_r1's does.
  The prompt says so before the first token, so a stream needs to hold nothing to know it.

The split reads the output only; the reply is the target's own. Long thoughts are where
speculative decoding pays most: every token of them is drafted and verified as the answer's are.
"""
from __future__ import annotations

from .tool_calls import tag_start_at_end

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def prompt_opens_thought(prompt_text: str) -> bool:
    """Whether a prompt (its end is enough) leaves the reply inside an opened thought."""
    return prompt_text.rstrip().endswith(START)


def split_reasoning(text: str, parser: str, opened: bool = False) -> tuple[str | None, str | None]:
    """A whole reply -> (its reasoning, its answer); None for an empty part. opened: the prompt
    opened the thought (prompt_opens_thought), so the reply starts inside it."""
    if parser == "qwen3" and not opened and (START not in text or END not in text.split(START, 1)[1]):
        return None, text or None  # no closed thought: all answer
    if parser == "qwen3" and not opened:
        before, after = text.split(START, 1)
        reasoning, answer = after.split(END, 1)
        return reasoning or None, (before + answer) or None
    body = text.split(START, 1)[1] if text.startswith(START) else text
    if END not in body:
        return body or None, None  # cut off while thinking
    reasoning, answer = body.split(END, 1)
    return reasoning or None, answer or None


class ReasoningStream:
    """A streamed reply's pieces -> deltas: {"reasoning_content": ...} while the model thinks,
    {"content": ...} after, text that may be a tag held until it is or cannot be one.

    A qwen3 reply's thought is known to be one only when it closes; until then its text is sent
    as reasoning (vLLM's qwen3 stream does the same), so a reply that opens <think> and never
    closes it streams as reasoning where the whole reply reads as answer."""

    def __init__(self, parser: str, opened: bool = False):
        self.inside_from_start = parser == "deepseek_r1" or opened  # else qwen3 starts before the thought
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
            tag = END if self.state == "thinking" else START
            if self.inside_from_start and not self.started:
                if START.startswith(self.held):  # a leading <think>, perhaps not yet whole
                    if self.held == START:
                        self.held, self.started = "", True
                    break
                if self.held.startswith(START):
                    self.held = self.held[len(START):]
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
