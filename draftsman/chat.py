"""Chat prompts: conversations of {"role": ..., "content": ...} messages, rendered into token ids by
the target tokenizer's own chat template (Hugging Face's apply_chat_template, as vLLM's LLM.chat
does). An instruct model answers well only in the format it was tuned on; the template is that
format, so it comes from the target folder, never from draftsman."""
from __future__ import annotations

import inspect

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
        out.append(message)
    return out


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

    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"}
    taken = sorted(set(template_kwargs) & own)
    if taken:
        raise ValueError(f"chat_template_kwargs {taken} are set by apply_chat_template itself, not free template "
                         "variables: use continue_final_message= to choose the turn; tools and documents are not "
                         "supported")
    return dict(template_kwargs)


def _render(tokenizer, conversation: Conversation, folder: str, **how) -> list[int]:
    """apply_chat_template's ids. The template writes the special tokens (BOS, turn markers)
    itself, so they are not added again. A template's own refusal (raise_exception: "roles must
    alternate", "system role not supported") becomes a ValueError that says whose template it is."""
    from jinja2 import TemplateError

    require_chat_template(tokenizer, folder)
    try:
        return list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **how))
    except TemplateError as e:
        raise ValueError(f"the chat template of target folder '{folder}' refused the conversation: {e}") from None


def chat_ids(tokenizer, conversation: Conversation, folder: str, continue_final_message: bool = False,
             template_kwargs: dict | None = None) -> list[int]:
    """The token ids of one conversation under the tokenizer's chat template, ending with the
    header of the assistant's turn (or, with continue_final_message, inside the last assistant
    message, so the model continues it). template_kwargs: extra template variables."""
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message continues the last message, which must be the assistant's; "
                         f"it is the {conversation[-1]['role']!r} message")
    return _render(tokenizer, conversation, folder, add_generation_prompt=not continue_final_message,
                   continue_final_message=continue_final_message, **check_template_kwargs(template_kwargs))


def whole_conversation_ids(tokenizer, conversation: Conversation, folder: str) -> list[int]:
    """The token ids of a finished conversation under the chat template, replies included and no
    turn left open: training text in the format the target serves."""
    return _render(tokenizer, conversation, folder, add_generation_prompt=False)
