"""Tools in chat prompts: tool definitions (OpenAI-style function schemas) go to a tool-calling
model's chat template, as apply_chat_template(tools=...) and vLLM's LLM.chat(tools=...) pass them;
in a data_file, a conversation line may carry its "tools"."""
import json
import re
import shutil

import pytest
import torch
from transformers import AutoTokenizer

import draftsman
from draftsman import cli
from draftsman.training import heads as H
from draftsman.training.documents import ToolConversation, read_documents

from test_training_documents import config, rows, write
from tiny_models import chatml_ids, load_for_reference

NEW = 10
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# ChatML with the tools in a system turn and tool calls written as JSON (the shape of Qwen2.5's).
TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
                 "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK = [{"role": "user", "content": "def weather(city):"}]
CALLED = [*ASK, {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
          {"role": "tool", "content": "-3 C, snow"}, {"role": "assistant", "content": "return 'cold'"}]


def with_tools_turn(conversation):
    """The conversation as TOOL_TEMPLATE writes it, for chatml_ids: tools first, tool calls as JSON."""
    turns = [{"role": "system", "content": "Tools: " + json.dumps(TOOLS)}]
    for m in conversation:
        turns.append({**m, "content": json.dumps(m["tool_calls"])} if m.get("tool_calls") else m)
    return turns


@pytest.fixture(scope="module")
def tool_target(chat_target, tmp_path_factory):
    folder = shutil.copytree(chat_target[0], tmp_path_factory.mktemp("tools") / "target")
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return folder, AutoTokenizer.from_pretrained(folder)


def test_tools_are_rendered_by_the_template(tool_target):
    folder, tok = tool_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    assert dec.encode_chat(ASK, tools=TOOLS) == [chatml_ids(tok, with_tools_turn(ASK))]
    assert dec.encode_chat(CALLED[:3], tools=TOOLS) == [chatml_ids(tok, with_tools_turn(CALLED[:3]))]
    assert dec.encode_chat(ASK) == [chatml_ids(tok, ASK)]  # no tools, no tools turn


def test_chat_with_tools_equals_hugging_face_generate(tool_target):
    folder, tok = tool_target
    ids = torch.tensor([tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, return_dict=False)])
    want = load_for_reference(folder).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                               do_sample=False)[0, ids.shape[1]:].tolist()
    dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    assert dec.chat(ASK, tools=TOOLS, max_new_tokens=NEW).token_ids == [want]


def test_tools_refusals(tool_target, chat_target):
    folder, _ = tool_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    for bad in ([], {"type": "function"}, ["get_weather"]):
        with pytest.raises(ValueError, match=r"tools must be a non-empty list of tool definitions like \{'type'"):
            dec.encode_chat(ASK, tools=bad)
    # A template that never reads tools would drop them without a word.
    plain = draftsman.load({"target": {"path": str(chat_target[0])}})
    with pytest.raises(ValueError, match="never reads `tools`, so the tool definitions would be dropped"):
        plain.encode_chat(ASK, tools=TOOLS)
    with pytest.raises(ValueError, match=r"\['tools'\] are set by apply_chat_template itself.*tools= for tool"):
        dec.encode_chat(ASK, chat_template_kwargs={"tools": TOOLS})


def test_cli_tools(tool_target, tmp_path, capsys):
    folder, _ = tool_target
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    base = ["generate", "--set", f"target.path={folder}", "--max-new-tokens", str(NEW), "--json"]
    assert cli.main([*base, "--chat", ASK[0]["content"], "--tools", str(tools)]) == 0
    want = draftsman.load({"target": {"path": str(folder)}}).chat(ASK, tools=TOOLS, max_new_tokens=NEW)
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    (tmp_path / "bad.json").write_text("{'type': 'function'}")
    (tmp_path / "one.json").write_text(json.dumps(TOOLS[0]))
    nowhere = ["generate", "--set", "target.path=/no/such/model"]  # refused before any model loads
    for args, message in [(["--chat", "hi", "--tools", "/no/such.json"], "--tools: no such file '/no/such.json'"),
                          (["--chat", "hi", "--tools", str(tmp_path / "bad.json")], "is not valid JSON"),
                          (["--chat", "hi", "--tools", str(tmp_path / "one.json")], "must be a non-empty list"),
                          (["--prompt", "a", "--tools", str(tools)], "--tools goes with --chat or --messages")]:
        assert cli.main([*nowhere, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_data_file_lines_carry_their_tools(tool_target, tmp_path):
    """A conversation line's "tools" are rendered with it; under assistant_only_loss the tools turn
    and the tool's result are context, the call and the answer are learned."""
    folder, tok = tool_target
    data = [*rows(), *({"messages": CALLED, "tools": TOOLS} for _ in range(40))]
    data = [{**r, "messages": [*r["messages"][:-1], {**r["messages"][-1], "content": f"{i}"}]} if "tools" in r else r
            for i, r in enumerate(data)]  # each line its own text
    path = write(tmp_path / "tools.jsonl", data)
    train_docs, held_docs = read_documents(path)
    with_tools = [d for _, d in train_docs + held_docs if isinstance(d, ToolConversation)]
    assert len(with_tools) == 40 and all(d.tools == TOOLS for d in with_tools)
    cfg = H.load_config(config(folder, tmp_path, path, assistant_only_loss=True))
    streams = H.token_streams(cfg, AutoTokenizer.from_pretrained(folder))
    masks = H.reply_masks(cfg, AutoTokenizer.from_pretrained(folder))
    for stream, mask, docs in zip(streams, masks, (train_docs, held_docs)):
        want_ids, want_reply = [], ""
        for _, doc in docs:
            if isinstance(doc, ToolConversation):
                want_ids += chatml_ids(tok, with_tools_turn(doc.messages), open_turn=False)
                want_reply += json.dumps(doc.messages[1]["tool_calls"]) + "<|im_end|>\n"
                want_reply += doc.messages[-1]["content"] + "<|im_end|>\n"
            elif isinstance(doc, list):
                want_ids += chatml_ids(tok, doc, open_turn=False)
                want_reply += doc[-1]["content"] + "<|im_end|>\n"
            else:
                want_ids += tok(doc)["input_ids"]
                want_reply += doc
            want_ids.append(tok.eos_token_id)
        assert stream.tolist() == want_ids
        assert tok.decode([int(t) for t, m in zip(stream, mask) if m]) == want_reply
    bad = write(tmp_path / "bad.jsonl", [rows(1)[0], {"text": "x = 1", "tools": TOOLS}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: \"tools\" go with a conversation"):
        read_documents(bad)
    bad = write(tmp_path / "bad2.jsonl", [rows(1)[0], {"messages": ASK, "tools": "get_weather"}])
    with pytest.raises(ValueError, match="bad2.jsonl:2: tools must be a non-empty list"):
        read_documents(bad)


def test_audit_and_compare_prompt_files_take_tools(tool_target, tmp_path, capsys):
    from draftsman import audit
    from draftsman.bench import compare, prompts_set

    folder, tok = tool_target
    path = write(tmp_path / "prompts.jsonl", [{"messages": ASK, "tools": TOOLS}, {"messages": ASK}])
    dec = draftsman.load({"target": {"path": str(folder)}})
    want = [chatml_ids(tok, with_tools_turn(ASK)), chatml_ids(tok, ASK)]
    assert audit.encode_prompts(dec, audit.read_prompts(path)) == want
    prompts = prompts_set.read_prompts(path)[0]
    assert compare._encode(dec, prompts, max_new_tokens=NEW) == want
    prompts_set.write_prompts(tmp_path / "again.jsonl", prompts, {})  # tools survive a rewrite, only where given
    assert prompts_set.read_prompts(tmp_path / "again.jsonl")[0] == prompts
    assert '"tools"' not in (tmp_path / "again.jsonl").read_text().splitlines()[2]
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3}}))
    assert cli.main(["audit", "--config", str(config), "--prompts", str(path), "--only", "greedy",
                     "--max-new-tokens", str(NEW), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]
    for line, message in [({"text": "a", "tools": TOOLS}, '"tools" go with "messages"'),
                          ({"messages": ASK, "tools": {"name": "x"}}, '"tools": tools must be a non-empty list')]:
        write(path, [line])
        for read in (audit.read_prompts, prompts_set.read_prompts):
            with pytest.raises(ValueError, match=f"prompts.jsonl:1: .*{message}"):
                read(path)


BAD_TOOLS = [  # (tools, what the error says): accepted without a word before, and rendered into the prompt
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0] is not a function tool"),
    ([{"type": "retrieval"}], "tools[0] is not a function tool"),
    ([*TOOLS, {"type": "function", "function": {"name": "f", "parameters": "x"}}],
     "tool 'f': \"parameters\" must be a JSON schema object"),
    (ASK, "tools[0] is not a function tool"),  # a messages file given as --tools
]


def test_tool_definitions_and_earlier_calls_are_checked_where_they_enter(tool_target, tmp_path, capsys):
    """One check (chat.check_tools) for the Python API, the CLI and the server (tests/test_serve_tool_calls.py),
    as vLLM's request model checks tools; an earlier call's tool_calls given as a dict is named too."""
    folder, _ = tool_target
    dec = draftsman.load({"target": {"path": str(folder)}})
    for tools, message in BAD_TOOLS:
        for entry in (dec.encode_chat, dec.chat):
            with pytest.raises(ValueError, match=re.escape(message)):
                entry(ASK, tools=tools, max_new_tokens=1) if entry == dec.chat else entry(ASK, tools=tools)
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps(ASK))
    assert cli.main(["generate", "--set", "target.path=/no/such/model", "--chat", "hi", "--tools", str(messages)]) == 2
    assert "tools[0] is not a function tool" in capsys.readouterr().err
    as_dict = [*ASK, {"role": "assistant", "tool_calls": {"id": "c1"}}]  # the template's 'str object' error
    with pytest.raises(ValueError, match=r"message 1: 'tool_calls' must be a list of calls like \{'id'"):
        dec.encode_chat(as_dict, tools=TOOLS)
