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
    """One conversation: a non-empty list of {"role": ..., "content": ...} messages."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where} is {conversation!r}: expected a non-empty list of messages like {MESSAGE_SHAPE}")
    for j, message in enumerate(conversation):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]):
            raise ValueError(f"{where}, message {j}: expected a dict with a 'role' and a 'content', "
                             f"like {MESSAGE_SHAPE}; got {message!r}")
        if not isinstance(message.get("content", ""), (str, list)):
            raise ValueError(f"{where}, message {j}: 'content' must be text, got {message['content']!r}")
    return list(conversation)


def require_chat_template(tokenizer, folder: str) -> None:
    if tokenizer is None:
        raise ValueError(f"target folder '{folder}' has no tokenizer, so it has no chat template: "
                         "pass input_ids=[[...], ...] instead of messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer in target folder '{folder}' has no chat template, so it cannot turn "
                         "messages into a prompt: use an instruct/chat model (its folder has chat_template.jinja "
                         "or a 'chat_template' in tokenizer_config.json), or pass plain text (generate(prompts), "
                         "--prompt)")


def check_template_kwargs(tokenizer, template_kwargs: dict | None) -> dict:
    """Extra variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking);
    a name that apply_chat_template takes itself would be swallowed there, so it is refused."""
    if not template_kwargs:
        return {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of template variable names to values, "
                         f"got {template_kwargs!r}")
    taken = sorted(set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if taken:
        raise ValueError(f"chat_template_kwargs {taken} are apply_chat_template's own arguments, not template "
                         "variables: use continue_final_message= for the turn, and leave the rest to draftsman")
    return dict(template_kwargs)


def chat_ids(tokenizer, conversation: Conversation, folder: str, continue_final_message: bool = False,
             template_kwargs: dict | None = None) -> list[int]:
    """The token ids of one conversation under the tokenizer's chat template, ending with the
    header of the assistant's turn (or, with continue_final_message, inside the last assistant
    message, so the model continues it). template_kwargs: extra template variables."""
    require_chat_template(tokenizer, folder)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message continues the last message, which must be the assistant's; "
                         f"it is the {conversation[-1]['role']!r} message")
    # The template writes the special tokens (BOS, turn markers) itself: apply_chat_template
    # tokenizes its text without adding them again.
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=not continue_final_message,
                                              continue_final_message=continue_final_message, tokenize=True,
                                              return_dict=False, **check_template_kwargs(tokenizer, template_kwargs)))


def whole_conversation_ids(tokenizer, conversation: Conversation, folder: str) -> list[int]:
    """The token ids of a finished conversation under the chat template, replies included and no
    turn left open: training text in the format the target serves."""
    require_chat_template(tokenizer, folder)
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True,
                                              return_dict=False))
