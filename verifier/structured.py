"""Structured output (vLLM's structured_outputs, OpenAI's response_format): a row's new tokens held
to a grammar, a JSON schema, a regex, a choice among strings or a Lark grammar, compiled by
llguidance (the grammar engine of vLLM's "guidance" backend). This file holds what a user gives;
verifier/grammar.py compiles it and masks the target's logits.

At every tree node the target's logits get -inf for each token the grammar does not allow after
that node's own sequence (the row's output so far, then the node's path in the block), before the
warpers, as the bans are (verifier/ngram_ban.py). The output is then distributed exactly as plain
decoding under the same mask: the target's distribution restricted to what the grammar allows and
renormalised, token by token. Drafters draft within the grammar too (drafters/path_bans.py,
verifier/grammar.py's DraftGrammar); drafts only, so exactness does not rest on it: a draft the
grammar forbids has probability 0 under the target, and the verifier rejects it.

A row ends where the grammar lets it: the row's end tokens (EOS, its stop_token_ids) are allowed
exactly where the grammar may end, and once it is complete nothing else is. So min_new_tokens and
ignore_eos, which hold EOS back, are refused with a grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# What a structured_output may name: one of these keys (vLLM's StructuredOutputsParams).
KINDS = {
    "json": "a JSON schema (a dict, or its JSON text): the output is JSON that the schema accepts",
    "json_object": "true: the output is any JSON object (OpenAI's response_format json_object)",
    "regex": "a regular expression the whole output matches",
    "choice": "a list of strings: the output is exactly one of them",
    "grammar": "a Lark grammar (llguidance's dialect) the output is a sentence of",
}
# Beside json / json_object (vLLM's): no whitespace but ", " and ": " between items, as Python's
# json.dumps writes; else JSON may have any whitespace between tokens, which a small model can
# fill with newlines.
OPTIONS = ("disable_any_whitespace",)


@dataclass(frozen=True)
class StructuredOutput:
    """One grammar, kept as its kind and canonical text so settings compare and hash (rows of a
    batch are grouped by their settings)."""
    kind: str  # "json", "regex", "choice" or "grammar" (json_object is the schema {"type": "object"})
    text: str  # JSON schema text, regex, JSON list of choices, Lark grammar
    compact: bool = False  # json only: disable_any_whitespace
    # The grammar holds the output only after these tokens first appear in it (a thought's end,
    # "</think>", under a reasoning parser, as vLLM does); () = from the first token. Set by the
    # chat paths (draftsman/replies.py's grammar_after_thought), not by users.
    after: tuple[int, ...] = ()

    @staticmethod
    def parse(value) -> "StructuredOutput | None":
        """None, a StructuredOutput, or a dict with exactly one of KINDS' keys."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        kinds = [key for key in value if key in KINDS] if isinstance(value, dict) else []
        if len(kinds) != 1:
            keys = "; ".join(f"{key}: {what}" for key, what in KINDS.items())
            raise ValueError(f"structured_output must be a dict with exactly one of {sorted(KINDS)} ({keys}), "
                             f"e.g. {{'json': {{'type': 'object'}}}}, got {value!r}")
        kind, given = kinds[0], value[kinds[0]]
        unknown = sorted(set(value) - {kind, *OPTIONS})
        if unknown:
            raise ValueError(f"structured_output has unknown key(s) {unknown}; valid: one of {sorted(KINDS)}, "
                             f"and {list(OPTIONS)} with json or json_object")
        compact = value.get("disable_any_whitespace", False)
        if not isinstance(compact, bool) or compact and kind not in ("json", "json_object"):
            raise ValueError(f"structured_output disable_any_whitespace must be true or false, with json or "
                             f"json_object, got {compact!r} with {kind}")
        if kind == "json_object":
            if given is not True:
                raise ValueError(f"structured_output json_object must be true, got {given!r}")
            return StructuredOutput("json", json.dumps({"type": "object"}), compact)
        if kind == "json":
            if isinstance(given, str):
                try:
                    given = json.loads(given)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_output json is text that is not JSON ({e}): give the schema "
                                     "as a dict or its JSON text") from None
            if not isinstance(given, (dict, bool)):
                raise ValueError(f"structured_output json must be a JSON schema (an object), got {given!r}")
            return StructuredOutput("json", json.dumps(given), compact)  # key order kept: it orders the properties
        if kind == "choice":
            if not isinstance(given, (list, tuple)) or not given or \
                    not all(isinstance(c, str) and c for c in given):
                raise ValueError(f"structured_output choice must be a list of non-empty strings, got {given!r}")
            return StructuredOutput("choice", json.dumps(list(given)))
        if not isinstance(given, str) or not given:
            raise ValueError(f"structured_output {kind} must be a non-empty string, got {given!r}")
        return StructuredOutput(kind, given)

    def grammar(self) -> str:
        """The llguidance grammar."""
        from llguidance import LLMatcher
        if self.kind == "json":
            compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            return LLMatcher.grammar_from_json_schema(self.text, overrides=compact if self.compact else None)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.text)))
        return LLMatcher.grammar_from_lark(self.text)

    def describe(self) -> str:
        text = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        return f"{self.kind} {text}" + (" (disable_any_whitespace)" if self.compact else "") + \
            (" (held after the thought ends)" if self.after else "")  # not its token ids: users read this
