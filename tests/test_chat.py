"""Chat prompts: conversations rendered by the target tokenizer's own chat template (ChatML behind a
BOS here, with turn markers as special tokens), then decoded exactly as token-id prompts are."""
import json
import shutil

import pytest
import torch

import draftsman
from draftsman import cli

from tiny_models import build_model_folder, build_tokenizer, chatml_ids, load_for_reference

NEW = 12
SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "def parse(text):"}],
    [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"},
     {"role": "user", "content": "for i in range(10):"}],
]


def test_encode_chat_renders_the_template_with_one_bos_and_the_assistant_turn_open(chat_target):
    folder, tok = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    assert dec.encode_chat(CONVERSATIONS) == [chatml_ids(tok, c) for c in CONVERSATIONS]
    assert dec.encode_chat(CONVERSATIONS[0]) == [chatml_ids(tok, CONVERSATIONS[0])]  # one conversation
    # Plain text through this tokenizer gets a BOS of its own: the template's must not be doubled.
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    ongoing = [*CONVERSATIONS[1][:2]]
    continued = dec.encode_chat(ongoing, continue_final_message=True)[0]
    assert continued == chatml_ids(tok, ongoing)[: -(len(tok("<|im_end|>\n<|im_start|>assistant\n",
                                                              add_special_tokens=False)["input_ids"]))]
    assert tok.decode(continued).endswith("assistant\nimport sys")


@pytest.mark.parametrize("drafter", [{"name": "none"}, {"name": "ngram", "k": 3, "branches": 2, "min_ngram": 1}])
def test_chat_equals_hugging_face_generate_on_the_template_ids(chat_target, drafter):
    """Greedy, a batch of two ragged conversations and each alone: the same tokens as HF's generate
    on apply_chat_template's ids, and text without the special tokens."""
    folder, tok = chat_target
    model = load_for_reference(folder)
    dec = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
    want = []
    for conversation in CONVERSATIONS:
        ids = torch.tensor([tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)])
        row = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        want.append(row[0, ids.shape[1]:].tolist())
    both = dec.chat(CONVERSATIONS, max_new_tokens=NEW)
    assert both.token_ids == want
    assert [dec.chat(c, max_new_tokens=NEW).token_ids[0] for c in CONVERSATIONS] == want
    assert both.texts == [tok.decode(row, skip_special_tokens=True) for row in want]


def test_the_end_of_turn_token_ends_a_reply(chat_target):
    """<|im_end|> is in the generation config's eos_token_id: favoured, it ends the row at once,
    and the reply's text leaves it out."""
    folder, tok = chat_target
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    out = draftsman.load({"target": {"path": str(folder)}}).chat(
        CONVERSATIONS[0], max_new_tokens=NEW, logit_bias={end_of_turn: 100})
    assert out.token_ids == [[end_of_turn]] and out.texts == [""]


def test_stream_of_a_conversation_joins_to_chat(chat_target):
    folder, _ = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    pieces = list(dec.stream(input_ids=dec.encode_chat(CONVERSATIONS[1])[0], max_new_tokens=NEW))
    assert "".join(pieces) == dec.chat(CONVERSATIONS[1], max_new_tokens=NEW).texts[0] != ""


@pytest.mark.parametrize("conversations, message", [
    ([], "non-empty list of messages"),
    ({"role": "user", "content": "hi"}, "got one message: wrap it as ["),
    ([[{"role": "user", "content": "hi"}], []], "conversation 1 is []"),
    ([{"content": "hi"}], "the conversation, message 0: expected a dict with a 'role'"),
    ([{"role": "user", "content": "hi"}, "hello"], "message 1"),
    ([{"role": "user", "content": 3}], "'content' must be a string, a list of text parts or null"),
    # rendered as an empty user turn: the model answered nothing
    ([{"role": "user", "text": "hi"}], "message 0 ('user') has no 'content' (its keys: ['role', 'text'])"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
])
def test_malformed_conversations_are_named(chat_target, conversations, message):
    dec = draftsman.load({"target": {"path": str(chat_target[0])}})
    with pytest.raises(ValueError, match=None) as e:
        dec.chat(conversations)
    assert message in str(e.value)


def test_chat_refusals_name_the_fix(chat_target, tmp_path):
    dec = draftsman.load({"target": {"path": str(chat_target[0])}})
    with pytest.raises(ValueError, match="last message, which must be the assistant's; it is the 'user'"):
        dec.encode_chat(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match="takes its prompts as messages"):
        dec.chat(CONVERSATIONS[0], input_ids=[[1, 2]])
    plain = build_model_folder(tmp_path / "plain", "llama", seed=3, tokenizer=build_tokenizer(tmp_path / "tok"))
    with pytest.raises(ValueError, match="has no chat template.*use an instruct/chat model"):
        draftsman.load({"target": {"path": str(plain)}}).chat(CONVERSATIONS[0])


def test_cli_chat_system_and_messages(chat_target, tmp_path, capsys):
    folder, _ = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    base = ["generate", "--set", f"target.path={folder}", "--max-new-tokens", str(NEW)]
    want = dec.chat(CONVERSATIONS[0], max_new_tokens=NEW)
    assert cli.main([*base, "--chat", "def parse(text):", "--system", "Be brief.", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    assert cli.main([*base, "--chat", "def parse(text):", "--system", "Be brief."]) == 0  # streamed
    assert capsys.readouterr().out.startswith(want.texts[0] + "\n[stats]")
    messages = tmp_path / "conversations.json"
    messages.write_text(json.dumps(CONVERSATIONS))
    assert cli.main([*base, "--messages", str(messages), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == dec.chat(CONVERSATIONS, max_new_tokens=NEW).token_ids
    # .jsonl: one conversation a line, a list or OpenAI's {"messages": [...]}; blank lines skipped
    lines = tmp_path / "conversations.jsonl"
    lines.write_text(f"{json.dumps(CONVERSATIONS[0])}\n\n{json.dumps({'messages': CONVERSATIONS[1], 'id': 7})}\n")
    assert cli.main([*base, "--messages", str(lines), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == dec.chat(CONVERSATIONS, max_new_tokens=NEW).token_ids


@pytest.mark.parametrize("args, message", [
    (["--chat", "hi", "--prompt", "a"], "give the prompts one way"),
    (["--prompt", "a", "--system", "Be brief."], "--system goes with --chat"),
    (["--messages", "/no/such.json"], "--messages: no such file '/no/such.json'"),
    (["--messages", "BAD_JSON"], "is not valid JSON"),
    (["--messages", "ONE_MESSAGE"], "got one message: wrap it as ["),
    (["--messages", "MESSAGE_LINES"], "lines.jsonl:1: each line of a .jsonl file is a conversation"),
    (["--messages", "BAD_LINE"], "bad.jsonl:2: not valid JSON"),
    (["--messages", "NO_LINES"], "has no conversations"),
    (["--messages", "LISTS.json"], "(or a .jsonl file, one conversation a line)"),  # JSON Lines named .json
])
def test_cli_chat_errors_exit_2_before_loading_a_model(args, message, tmp_path, capsys):
    message_line = json.dumps({"role": "user", "content": "hi"})
    files = {"BAD_JSON": ("bad.json", "[{'role': 'user'}]"), "ONE_MESSAGE": ("one.json", message_line),
             "MESSAGE_LINES": ("lines.jsonl", f"{message_line}\n{message_line}\n"),
             "BAD_LINE": ("bad.jsonl", f"[{message_line}]\n[{{'role'\n"), "NO_LINES": ("empty.jsonl", "\n"),
             "LISTS.json": ("lists.json", f"[{message_line}]\n[{message_line}]\n")}
    for name, text in files.values():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / files[a][0]) if a in files else a for a in args]
    # The target folder does not exist: these must fail on the prompts, before any load.
    assert cli.main(["generate", "--set", "target.path=/no/such/model", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- prompt files: audit and compare

CHAT_LINES = [{"messages": CONVERSATIONS[0]}, {"text": "import os\n"}, {"messages": CONVERSATIONS[1], "category": "c"}]


def test_prompt_files_take_conversations_as_messages(tmp_path):
    from draftsman import audit
    from draftsman.bench import prompts_set

    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in CHAT_LINES) + "\n")
    assert audit.read_prompts(path) == [CONVERSATIONS[0], "import os\n", CONVERSATIONS[1]]
    prompts, _ = prompts_set.read_prompts(path)
    assert [(p.messages, p.text, p.category) for p in prompts] == [
        (CONVERSATIONS[0], "", "default"), (None, "import os\n", "default"), (CONVERSATIONS[1], "", "c")]
    prompts_set.write_prompts(tmp_path / "again.jsonl", prompts, {})
    assert prompts_set.read_prompts(tmp_path / "again.jsonl")[0] == prompts
    assert "messages" not in (tmp_path / "again.jsonl").read_text().splitlines()[2]  # text rows stay as they were

    for line, message in [({"messages": [{"content": "hi"}]}, 'chat.jsonl:1: "messages": the conversation, message 0'),
                          ({"messages": []}, 'chat.jsonl:1: "messages": the conversation is []')]:
        path.write_text(json.dumps(line) + "\n")
        for read in (audit.read_prompts, prompts_set.read_prompts):
            with pytest.raises(ValueError) as e:
                read(path)
            assert message in str(e.value), (read, e.value)
    path.write_text(json.dumps({"text": "a", "messages": CONVERSATIONS[0]}) + "\n")
    for read in (audit.read_prompts, prompts_set.read_prompts):
        with pytest.raises(ValueError, match=r'one of "text", "messages" or "input_ids"; this one has \['):
            read(path)


def test_audit_and_compare_render_messages_through_the_chat_template(chat_target, tmp_path, capsys):
    from draftsman import audit
    from draftsman.bench import compare, prompts_set

    folder, tok = chat_target
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in CHAT_LINES) + "\n")
    dec = draftsman.load({"target": {"path": str(folder)}})
    want = [chatml_ids(tok, CONVERSATIONS[0]), tok("import os\n")["input_ids"], chatml_ids(tok, CONVERSATIONS[1])]
    assert audit.encode_prompts(dec, audit.read_prompts(path)) == want
    assert compare._encode(dec, prompts_set.read_prompts(path)[0], max_new_tokens=8) == want
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [5, 6, 7]}\n')
    assert compare._encode(dec, prompts_set.read_prompts(ids)[0], max_new_tokens=8) == [[5, 6, 7]]
    assert audit.encode_prompts(dec, audit.read_prompts(ids)) == [[5, 6, 7]]

    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3}}))
    assert cli.main(["audit", "--config", str(config), "--prompts", str(path), "--only", "greedy",
                     "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and len(result["greedy"]["prompts"]) == 3


def test_chat_template_kwargs_reach_the_template(chat_target, capsys):
    """vLLM's chat_template_kwargs: Qwen3's enable_thinking=False writes an empty thought after the
    assistant's header; a name apply_chat_template takes itself is refused."""
    folder, tok = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    plain = chatml_ids(tok, CONVERSATIONS[0])
    no_thinking = plain + tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert dec.encode_chat(CONVERSATIONS[0], chat_template_kwargs={"enable_thinking": False}) == [no_thinking]
    assert dec.encode_chat(CONVERSATIONS[0], chat_template_kwargs={"enable_thinking": True}) == [plain]
    want = dec.generate(input_ids=[no_thinking], max_new_tokens=NEW).token_ids
    assert dec.chat(CONVERSATIONS[0], chat_template_kwargs={"enable_thinking": False}, max_new_tokens=NEW).token_ids \
        == want
    with pytest.raises(ValueError, match=r"chat_template_kwargs \['add_generation_prompt'\] are set by apply_chat_t"):
        dec.encode_chat(CONVERSATIONS[0], chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="must be a dict of template variable names"):
        dec.encode_chat(CONVERSATIONS[0], chat_template_kwargs=[("enable_thinking", False)])
    args = ["generate", "--set", f"target.path={folder}", "--max-new-tokens", str(NEW), "--json",
            "--chat", "def parse(text):", "--system", "Be brief."]
    assert cli.main([*args, "--chat-template-kwarg", "enable_thinking=false"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert cli.main(["generate", "--prompt", "a", "--chat-template-kwarg", "enable_thinking=false"]) == 2
    assert "--chat-template-kwarg goes with --chat or --messages" in capsys.readouterr().err


def test_text_parts_tuples_and_null_content_render_as_plain_messages(chat_target):
    """OpenAI's content parts join into one string (vLLM's rendering for text templates); a tuple
    is a conversation too; content null (an assistant turn with tool calls) is dropped by HF."""
    folder, tok = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    parts = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "def parse("},
                                                  {"type": "text", "text": "text):"}]}]
    joined = [SYSTEM, {"role": "user", "content": "def parse(\ntext):"}]
    assert dec.encode_chat(parts) == dec.encode_chat(tuple(joined)) == [chatml_ids(tok, joined)]
    assert parts[1]["content"][0]["text"] == "def parse("  # the caller's messages are left as they were
    dec.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])


def test_a_template_refusal_is_a_clear_error(chat_target, tmp_path, capsys):
    folder = shutil.copytree(chat_target[0], tmp_path / "no-system")
    template = folder / "chat_template.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}" + template.read_text())
    assert cli.main(["generate", "--set", f"target.path={folder}", "--chat", "hi", "--system", "x"]) == 2
    err = capsys.readouterr().err
    assert "chat template of target folder" in err and "System role not supported" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--chat-template-kwarg", "enable_thinking"], "expected NAME=VALUE"),
    (["--chat-template-kwarg", "messages=[]"], "['messages'] are set by apply_chat_template itself"),
])
def test_cli_template_kwargs_are_checked_before_loading_a_model(args, message, capsys):
    try:
        code = cli.main(["generate", "--set", "target.path=/no/such/model", "--chat", "hi", *args])
    except SystemExit as e:  # argparse's own usage error
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
