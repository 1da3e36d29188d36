"""Training documents from a JSONL file (`data_file` in a heads config), for heads trained on the
text a target will serve rather than on the bundled source corpus. One object per line:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   chat (HF / OpenAI)
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}     chat (ShareGPT, as
                                                                                  Medusa and EAGLE train)
    {"text": "..."}                                                               a plain document

A conversation line may carry "tools": [...] (OpenAI-style function schemas), which a tool-calling
template renders with it, as in function-calling datasets.

Conversations are rendered by the target tokenizer's own chat template, replies included, so the
heads see the turn markers and formatting they will draft after. With self-distilled labels (the
default) the heads learn the target's own pick at every position of this text, so replies written
by another model still teach this target's choices.
The held-out split is a hash of each line's text, as the corpus splits by file path.

assistant_only_loss: the heads learn only where the next token belongs to an assistant's reply
(the system and user turns are context, never drafted). A plain text document counts whole.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from draftsman.chat import (ToolConversation, check_conversation, tool_line, whole_conversation_ids,
                            whole_conversation_reply_mask)
from draftsman.json_lines import json_lines

from .corpus import HELDOUT_PERCENT, is_heldout

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
FORMATS = '{"messages": [...]}, {"conversations": [{"from": ..., "value": ...}]} (ShareGPT) or {"text": ...}'


Document = str | list[dict] | ToolConversation  # plain text, or a conversation (with its tools)
Numbered = tuple[str, Document]  # ("file:line", document): where a template's refusal points


def read_documents(path: str | Path, percent: int = HELDOUT_PERCENT) -> tuple[list[Numbered], list[Numbered]]:
    """(train, held-out) documents of a JSONL file, each with its "file:line"; a bad line is named
    with what to fix."""
    train, held = [], []
    for where, line, doc in iter_documents(path):
        (held if is_heldout(line.strip(), percent) else train).append((where, doc))
    if not train or not held:
        raise ValueError(f"data_file '{path}' gives {len(train)} training and {len(held)} held-out documents "
                         f"(about {percent}% are held out, by a hash of each line): both need some, so add lines")
    return train, held


def iter_documents(path: str | Path, what: str = "data_file"):
    """("file:line", the line's text, its document) for each non-blank line, in file order. what: the
    key or flag that named the file, for the errors."""
    path = _existing(path, what)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} '{path}' is not UTF-8 text ({e.reason} at byte {e.start}): "
                         "save it as UTF-8") from None
    for n, line, value in json_lines(text, str(path), f"each line holds one {FORMATS}"):
        try:
            doc = _document(value)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}; each line holds one {FORMATS}") from None
        yield f"{path}:{n}", line, doc


def data_file_digest(path: str | Path) -> str:
    """A short hash of the file's bytes: token caches built from it are keyed by its content."""
    return hashlib.sha256(_existing(path).read_bytes()).hexdigest()[:12]


def _existing(path: str | Path, what: str = "data_file") -> Path:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} '{path}' is a folder: give a JSONL file with one {FORMATS} per line")
    if not path.is_file():
        raise FileNotFoundError(f"{what} '{path}' does not exist: give a JSONL file with one {FORMATS} per line"
                                + (", or set data_file: null to train on corpus_root" if what == "data_file" else ""))
    return path


def _document(row) -> Document:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if row.get("tools") is not None:
        if "messages" not in row and "conversations" not in row:
            raise ValueError('"tools" go with a conversation ("messages" or "conversations"), not with "text"')
        return tool_line(row, _document({key: value for key, value in row.items() if key != "tools"}))
    if "messages" in row:
        return check_conversation(row["messages"])
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError('"conversations" must be a list of {"from": ..., "value": ...} turns')
        unknown = sorted({str(t.get("from")) for t in turns} - set(SHAREGPT_ROLES))
        if unknown:
            raise ValueError(f"ShareGPT roles {unknown} unknown; known: {sorted(SHAREGPT_ROLES)}")
        return check_conversation([{"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns])
    if isinstance(row.get("text"), str) and row["text"]:
        return row["text"]
    raise ValueError(f'no "messages", "conversations" or non-empty "text" among keys {sorted(row)}')


def document_ids(tokenizer, numbered: Numbered, target: str) -> list[int]:
    """A document's token ids: text as the corpus is tokenized, a conversation through the chat
    template (which writes its own special tokens, so none are added)."""
    if isinstance(numbered[1], str):
        return tokenizer(numbered[1])["input_ids"]
    return _through_template(whole_conversation_ids, tokenizer, numbered, target)


def document_ids_and_reply_mask(tokenizer, numbered: Numbered, target: str) -> tuple[list[int], list[int]]:
    """document_ids and a 0/1 mask over them, 1 where a token belongs to an assistant's reply (a
    plain text counts whole)."""
    if isinstance(numbered[1], str):  # its own text, not the BOS the tokenizer may add
        enc = tokenizer(numbered[1], return_special_tokens_mask=True)
        return enc["input_ids"], [1 - special for special in enc["special_tokens_mask"]]
    return _through_template(whole_conversation_reply_mask, tokenizer, numbered, target)


def _through_template(render, tokenizer, numbered: Numbered, target: str):
    """render(tokenizer, messages, target, tools) for a conversation document; a refusal (e.g. the
    template's "roles must alternate") names the line."""
    where, doc = numbered
    messages, tools = doc if isinstance(doc, ToolConversation) else (doc, None)
    try:
        return render(tokenizer, messages, target, tools)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
