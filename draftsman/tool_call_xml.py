"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`, vLLM's name): a block in the
hermes tags whose call is written as elements, each value as raw text (a block may hold several
<function=...> elements, as vLLM reads them),

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The text does not say a value's type, so it is read by the type the request's tool schema gives
the parameter, by vLLM's rules: "null" is null; a string type, or a parameter the schema does not
name, stays the text; integer and number types are read as numbers; object and array types as
JSON (then as a Python literal); a boolean is true or false. A value that does not read as its
type stays the text as written (where vLLM turns a boolean that is neither into false).
"""
from __future__ import annotations

import ast
import json
import math
import re

# Non-greedy, as vLLM's: one block may hold several <function=...> elements.
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def xml_calls_parts(block: str, tools: list[dict] | None) -> list[tuple[str, dict]] | None:
    """(name, arguments) of each call a block's text holds, or None when it is not wholly
    <function=...> elements of <parameter=...> elements (vLLM reads every function in a block)."""
    calls, at = [], 0
    while (function := _FUNCTION.match(block, at)) is not None:
        parts = _function_parts(function.group(1).strip(), function.group(2), tools)
        if parts is None:
            return None
        calls.append(parts)
        at = function.end()
    return calls if calls and not block[at:].strip() else None


def _function_parts(name: str, body: str, tools: list[dict] | None) -> tuple[str, dict] | None:
    """(name, arguments) of one <function=NAME> element's body, or None when it is not wholly parameters."""
    schema, arguments, at = _parameters_schema(name, tools), {}, 0
    while (parameter := _PARAMETER.match(body, at)) is not None:
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value.removeprefix("\n").removesuffix("\n")  # the lines the format puts around a value
        arguments[key] = typed_value(value, schema.get(key))
        at = parameter.end()
    return (name, arguments) if not body[at:].strip() else None


def _parameters_schema(name: str, tools: list[dict] | None) -> dict:
    """The tool's parameter schemas by name ({} when the request does not define the tool)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            if not isinstance(parameters, dict):
                return {}
            properties = parameters.get("properties", parameters)
            return properties if isinstance(properties, dict) else {}
    return {}


def typed_value(text: str, schema) -> object:
    """A parameter's text read as the type its schema names (the module's rules)."""
    if text.lower() == "null":
        return None
    if not isinstance(schema, dict):  # a parameter the schema does not name: the text
        return text
    kind = str(schema.get("type", "string")).strip().lower()
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):  # JSON has no inf or nan
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), text)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)  # a set, bytes, inf: no JSON for it
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
