"""Forced tool calls: OpenAI's tool_choice "required" and a named function, as vLLM serves them. The
reply is held by a grammar (verifier/structured.py) to what the tool choice allows, and read back
as OpenAI's tool_calls:

The JSON is compact (no whitespace but ", " and ": ", vLLM's disable_any_whitespace).

- a named function ({"type": "function", "function": {"name": "get_weather"}}): the reply is that
  function's arguments, a JSON object its parameters' schema accepts; finish reason "stop", as
  OpenAI and vLLM answer a named call;
- "required": the reply is a JSON list of at least one {"name": ..., "parameters": {...}}, each
  name one of the request's tools and its parameters what that tool's schema accepts; finish
  reason "tool_calls". Under parallel_tool_calls false, a list of exactly one.

The output is exactly the target's under that grammar (plain decoding with the grammar's mask),
not its unconstrained output: the grammar is what the request asked for.
"""
from __future__ import annotations

import json

from .tool_calls import tool_call

NO_PARAMETERS = {"type": "object", "properties": {}}


def check_tool_choice(choice) -> tuple[str, str | None]:
    """OpenAI's tool_choice (None: "auto") -> (kind, function name): ("auto" | "none" | "required",
    None) or ("function", NAME); any other value refused with the forms it may take."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function" or set(choice) - {"type", "function"} \
            or not isinstance(function.get("name"), str):
        raise ValueError(f'"tool_choice" must be "auto", "none", "required" or {{"type": "function", "function": '
                         f'{{"name": NAME}}}}, got {json.dumps(choice)}')
    return "function", function["name"]


def forced_calls(choice, tools: list[dict] | None, parallel: bool = True) -> "ForcedCalls | None":
    """The calls a tool_choice forces ("required", a named function), or None ("auto", "none").
    parallel: OpenAI's parallel_tool_calls; False holds "required" to one call."""
    kind, name = check_tool_choice(choice)
    if kind in ("auto", "none"):
        return None
    if not tools:
        raise ValueError(f'"tool_choice" {json.dumps(choice)} goes with "tools": send the tools it chooses among')
    return ForcedCalls(tools, name, parallel)


def functions_of(tools: list[dict]) -> dict[str, dict]:
    """{name: parameters schema} of a request's tools (OpenAI's {"type": "function", "function": {...}})."""
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError('a forced tool call needs each tool as {"type": "function", "function": {"name": ..., '
                             f'"parameters": {{...}}}}}}, got {json.dumps(tool)[:200]}')
        parameters = function.get("parameters") or NO_PARAMETERS
        if not isinstance(parameters, dict) or not isinstance(parameters.get("$defs", {}), dict):
            raise ValueError(f'tool {function["name"]!r}: "parameters" must be a JSON schema object (its "$defs" an '
                             f'object of schemas), e.g. {json.dumps(NO_PARAMETERS)}; got '
                             f'{json.dumps(function.get("parameters"))[:200]}')
        functions[function["name"]] = parameters
    return functions


def check_schemas_compile(functions: dict[str, dict]) -> None:
    """Each tool's parameters schema, compiled alone: compiled inside the forced grammar, a bad one
    was refused as a "structured_output" the client never sent."""
    from llguidance import LLMatcher

    for name, parameters in functions.items():
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(parameters)), None)
        if error:
            raise ValueError(f'tool {name!r}: "parameters" is not a JSON schema that can hold a forced call '
                             f"({error.strip()}): fix the tool's parameters schema, or leave tool_choice out")


class ForcedCalls:
    """A request's forced calls: the grammar its reply is held to (`structured_output`) and how the
    reply reads back as calls (`opener` and `parse`, as tool_calls.py's whole-reply formats)."""

    def __init__(self, tools: list[dict], name: str | None = None, parallel: bool = True):
        functions = functions_of(tools)
        check_schemas_compile(functions)
        if name is not None and name not in functions:
            raise ValueError(f'tool_choice names function {name!r}, which "tools" does not define; defined: '
                             f"{sorted(functions)}")
        self.name = name
        self.keeps_stop = name is not None  # a named call ends with "stop"; "required" with "tool_calls"
        self.opener = "{" if name is not None else "["
        if name is not None:
            schema = functions[name]
        else:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": tool}, "parameters": _without_defs(parameters)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for tool, parameters in functions.items()]}}
            if not parallel:  # vLLM's reading of parallel_tool_calls false under "required"
                schema["maxItems"] = 1
            definitions = _hoisted_defs(functions)
            if definitions:  # "#/$defs/..." references resolve from the root, as they did in each tool
                schema["$defs"] = definitions
        # Compact: no whitespace but ", " and ": " (Python's json.dumps). Arguments are read by
        # programs, and free whitespace lets a weak model pad the JSON until max_tokens cuts it.
        self.structured_output = {"json": schema, "disable_any_whitespace": True}

    def parse(self, text: str) -> list[dict]:
        """The reply's calls; [] when it is not wholly what the grammar describes (a reply cut by
        max_tokens, for instance), so it stays content."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.name is not None:
            return [tool_call(self.name, text.strip())] if isinstance(value, dict) else []
        if not isinstance(value, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                                  for item in value):
            return []
        return [tool_call(item["name"], item.get("parameters", {})) for item in value]


def _without_defs(schema: dict) -> dict:
    return {key: value for key, value in schema.items() if key != "$defs"}


def _hoisted_defs(functions: dict[str, dict]) -> dict:
    """Every tool's "$defs", for the root of the "required" schema; two tools that define one name
    differently are refused (one root cannot hold both)."""
    definitions: dict = {}
    for tool, parameters in functions.items():
        for key, value in (parameters.get("$defs") or {}).items():
            if definitions.setdefault(key, value) != value:
                raise ValueError(f'tools define "$defs" {key!r} differently ({tool!r} among them): tool_choice '
                                 '"required" puts every tool in one schema; rename one of them')
    return definitions
