"""Chat prompts: conversations of {"role": ..., "content": ...} messages, rendered into token ids by
the target tokenizer's own chat template (Hugging Face's apply_chat_template, as vLLM's LLM.chat
does). An instruct model answers well only in the format it was tuned on; the template is that
format, so it comes from the target folder, never from draftsman."""
from __future__ import annotations

import inspect
import re
from typing import NamedTuple

Conversation = list[dict]

MESSAGE_SHAPE = "{'role': 'user', 'content': '...'}"


def check_conversations(conversations) -> list[Conversation]:
    """One conversation (a list of messages) or a list of them -> a list of conversations, each
    checked: a bad message is named by its place, before any model runs."""
    if isinstance(conversations, dict):
        raise ValueError(f"a conversation is a list of messages, got one message: wrap it as [{MESSAGE_SHAPE}]")
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError(f"expected a conversation (a non-empty list of messages like {MESSAGE_SHAPE}) or a "
                         f"list of conversations, got {conversations!r}")
    if isinstance(conversations[0], (list, tuple)):
        return [check_conversation(c, f"conversation {i}") for i, c in enumerate(conversations)]
    return [check_conversation(conversations)]


def check_conversation(conversation, where: str = "the conversation") -> Conversation:
    """One conversation: a non-empty list of {"role": ..., "content": ...} messages. Returns a copy
    in which content given as a list of text parts ([{"type": "text", "text": ...}, ...], the
    OpenAI form) is joined into one string, as vLLM does for templates that expect text."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where} is {conversation!r}: expected a non-empty list of messages like {MESSAGE_SHAPE}")
    out = []
    for j, message in enumerate(conversation):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]):
            raise ValueError(f"{where}, message {j}: expected a dict with a 'role' and a 'content', "
                             f"like {MESSAGE_SHAPE}; got {message!r}")
        if "content" not in message and not message.get("tool_calls") and not message.get("function_call"):
            # (a 'text' or 'message' key rendered an empty turn, and the model answered nothing)
            raise ValueError(f"{where}, message {j} ({message['role']!r}) has no 'content' (its keys: "
                             f"{sorted(message)}): give its text as 'content', like {MESSAGE_SHAPE}")
        check_message_tool_calls(message.get("tool_calls"), f"{where}, message {j}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise ValueError(f"{where}, message {j}: only text parts ({{'type': 'text', 'text': '...'}}) "
                                 f"can be rendered for a text model, got {content!r}")
            message = {**message, "content": "\n".join(part["text"] for part in content)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}, message {j}: 'content' must be a string, a list of text parts or "
                             f"null, got {content!r}")
        if isinstance(message.get("content"), str):
            check_unicode(message["content"], f"{where}, message {j}'s content")
        out.append(message)
    return out


CALL_SHAPE = "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': '{...}'}}"


def check_message_tool_calls(calls, where: str) -> None:
    """An assistant message's earlier calls, in OpenAI's shape: a dict or a call without a function
    reached the template, which refused it in its own words ('str object' has no attribute 'function')."""
    if calls is None:
        return
    if not isinstance(calls, (list, tuple)) or not all(
            isinstance(call, dict) and isinstance(call.get("function"), dict)
            and isinstance(call["function"].get("name"), str) for call in calls):
        raise ValueError(f"{where}: 'tool_calls' must be a list of calls like {CALL_SHAPE}, got {_short(calls)}")


def check_unicode(text: str, what: str) -> None:
    """Text a tokenizer can encode: a lone surrogate (JSON's "\\ud800", Python's "\\ud800") got the
    tokenizer's "TextEncodeInput must be Union[...]", which names neither the text nor the place."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: character {e.start} is {text[e.start]!r}, "
                         "half of a surrogate pair; send the whole character, or drop it") from None


def require_chat_template(tokenizer, folder: str) -> None:
    if tokenizer is None:
        raise ValueError(f"target folder '{folder}' has no tokenizer, so it has no chat template: "
                         "give the prompts as token ids instead of messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer in target folder '{folder}' has no chat template, so it cannot turn "
                         "messages into a prompt: use an instruct/chat model (its folder has chat_template.jinja "
                         "or a 'chat_template' in tokenizer_config.json), or pass plain text (generate(prompts), "
                         "--prompt)")


def check_template_kwargs(template_kwargs: dict | None) -> dict:
    """Extra variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking).
    A name that apply_chat_template takes itself, or that it passes to the template already, would
    change the call or collide there, so it is refused."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of template variable names to values, "
                         f"got {template_kwargs!r}")
    from transformers import PreTrainedTokenizerBase

    # (and the names _render's own call takes: "tokenizer" collided there with a TypeError)
    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"} | (
        set(inspect.signature(_apply_template).parameters) - {"how"})
    taken = sorted(set(template_kwargs) & own)
    if taken:
        raise ValueError(f"chat_template_kwargs {taken} are set by apply_chat_template itself, not free template "
                         "variables: use continue_final_message= to choose the turn and tools= for tool "
                         "definitions; documents are not supported")
    return dict(template_kwargs)


class ToolConversation(NamedTuple):
    """A conversation that offers tools to the model (a prompt or data_file line with "tools")."""
    messages: Conversation
    tools: list[dict]


def tool_line(row: dict, conversation: Conversation) -> Conversation | ToolConversation:
    """A JSONL line's checked conversation, with the line's "tools" when it has them."""
    return conversation if row.get("tools") is None else ToolConversation(conversation, check_tools(row["tools"]))


TOOL_SHAPE = "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}}"


def check_tools(tools) -> list[dict] | None:
    """Tool definitions for a tool-calling template (apply_chat_template's tools=, vLLM's): a
    non-empty list of JSON schemas in OpenAI's form. None: no tools."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not tools or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"tools must be a non-empty list of tool definitions like {TOOL_SHAPE}, got {tools!r}")
    for i, tool in enumerate(tools):
        check_tool(tool, i)
    return list(tools)


def check_tool(tool: dict, i: int) -> None:
    """One tool definition in OpenAI's form, as vLLM's request model checks it: a tool with no name
    (or a messages file given as --tools) was rendered into the prompt without a word."""
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict) or \
            not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tools[{i}] is not a function tool: each tool must be like {TOOL_SHAPE}, with a "
                         f"'name'; got {_short(tool)}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tool {function['name']!r}: \"parameters\" must be a JSON schema object, e.g. "
                         f"{{'type': 'object', 'properties': {{}}}}; got {_short(parameters)}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _render(tokenizer, conversation: Conversation, folder: str, **how) -> list[int]:
    """apply_chat_template's ids. The template writes the special tokens (BOS, turn markers)
    itself, so they are not added again. verbose=False: the tokenizer's "longer than the specified
    maximum" warning came before the engine's own error about the context (as in Decoder.encode)."""
    return list(_apply_template(tokenizer, conversation, folder, tokenize=True, return_dict=False,
                                tokenizer_kwargs={"verbose": False}, **how))


def _apply_template(tokenizer, conversation: Conversation, folder: str, **how):
    """apply_chat_template, with a template's own refusal (raise_exception: "roles must alternate",
    "system role not supported") turned into a ValueError that says whose template it is."""
    from jinja2 import TemplateError

    require_chat_template(tokenizer, folder)
    if how.get("tools") and "tools" not in tokenizer.get_chat_template(None, how["tools"]):
        raise ValueError(f"the chat template of target folder '{folder}' never reads `tools`, so the tool "
                         "definitions would be dropped without a word: use a tool-calling model's template, or "
                         "leave tools out")
    try:
        return tokenizer.apply_chat_template(conversation, **how)
    except TemplateError as e:
        raise ValueError(f"the chat template of target folder '{folder}' refused the conversation: {e}") from None


def chat_ids(tokenizer, conversation: Conversation, folder: str, continue_final_message: bool = False,
             template_kwargs: dict | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The token ids of one conversation under the tokenizer's chat template, ending with the
    header of the assistant's turn (or, with continue_final_message, inside the last assistant
    message, so the model continues it; with add_generation_prompt False, after the last message,
    no turn opened: vLLM's request field). template_kwargs: extra template variables; tools: tool
    definitions for a tool-calling template (check_tools)."""
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message continues the last message, which must be the assistant's; "
                         f"it is the {conversation[-1]['role']!r} message")
    opens_turn = add_generation_prompt and not continue_final_message
    return _render(tokenizer, conversation, folder, add_generation_prompt=opens_turn,
                   continue_final_message=continue_final_message, tools=check_tools(tools),
                   **check_template_kwargs(template_kwargs))


def whole_conversation_ids(tokenizer, conversation: Conversation, folder: str,
                           tools: list[dict] | None = None) -> list[int]:
    """The token ids of a finished conversation under the chat template, replies included and no
    turn left open: training text in the format the target serves. tools: its tool definitions."""
    return _render(tokenizer, conversation, folder, add_generation_prompt=False, tools=check_tools(tools))


# {% generation %} ... {% endgeneration %}: HF's markers around the assistant's text in a template.
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def whole_conversation_reply_mask(tokenizer, conversation: Conversation, folder: str,
                                  tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """whole_conversation_ids and a 0/1 mask over them: 1 on the tokens of the assistant's messages,
    0 on the system and user turns and on the header that opens each reply (training heads on the
    replies only, as EAGLE and Medusa do: drafts are only ever made inside a reply).

    A template with {% generation %} markers marks the replies itself (HF's
    return_assistant_tokens_mask). Other templates: reply k is the text that rendering the
    conversation through message k adds to rendering it up to message k with the reply's header
    opened. That needs a template that writes earlier turns the same whatever follows; one that
    rewrites them (e.g. dropping earlier reasoning) is refused rather than guessed at."""
    require_chat_template(tokenizer, folder)
    tools = check_tools(tools)
    if GENERATION_MARKER.search(tokenizer.get_chat_template(None, tools)):
        out = _apply_template(tokenizer, conversation, folder, tokenize=True, return_dict=True,
                              return_assistant_tokens_mask=True, add_generation_prompt=False, tools=tools)
        return list(out["input_ids"]), list(out["assistant_masks"])
    text = lambda turns, opened: _apply_template(tokenizer, turns, folder, tokenize=False,  # noqa: E731
                                                 add_generation_prompt=opened, tools=tools)
    whole = text(conversation, False)
    spans = []
    for k, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = text(conversation[:k], True) if k else ""  # an opening reply counts from the start
        through = text(conversation[: k + 1], False)
        if not (whole.startswith(through) and through.startswith(before)):
            raise ValueError(f"the chat template of target folder '{folder}' writes earlier turns differently once "
                             f"later ones follow, so message {k}'s reply cannot be located in the whole "
                             "conversation: set assistant_only_loss: false, or give the template "
                             "{% generation %} markers around the assistant's text")
        spans.append((len(before), len(through)))
    try:
        enc = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ValueError(f"assistant_only_loss needs character offsets, which the slow tokenizer of target folder "
                         f"'{folder}' does not give: save a fast tokenizer (tokenizer.json) there, or set "
                         "assistant_only_loss: false") from None
    # A token is in a reply when its characters overlap one (HF's rule for its own mask).
    in_reply = [int(any(first < end and last > begin for begin, end in spans)) for first, last in enc["offset_mapping"]]
    return list(enc["input_ids"]), in_reply
