"""Heads trained on a data_file: chat conversations (HF messages or ShareGPT turns) rendered by the
target's chat template, replies included, or plain texts; split held-out by a hash of each line."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from draftsman import cli
from draftsman.training.documents import read_documents
from draftsman.training.heads import load_config, target_token_frequencies, token_streams, train

from tiny_models import CORPUS, chatml_ids, reference_where_the_cli_counts


def rows(n: int = 120) -> list[dict]:
    """n lines cycling through the three formats, each with its own text."""
    out = []
    for i in range(n):
        code = CORPUS[i % 4].replace("10", str(i))
        if i % 3 == 0:
            out.append({"messages": [{"role": "user", "content": f"Task {i}"}, {"role": "assistant", "content": code}]})
        elif i % 3 == 1:
            out.append({"conversations": [{"from": "system", "value": "Be brief."},
                                          {"from": "human", "value": f"Task {i}"}, {"from": "gpt", "value": code}]})
        else:
            out.append({"text": code})
    return out


def as_document(row: dict):
    if "messages" in row:
        return row["messages"]
    if "conversations" in row:
        roles = {"system": "system", "human": "user", "gpt": "assistant"}
        return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    return row["text"]


def write(path, lines):
    path.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in lines) + "\n")
    return path


def test_documents_in_three_formats_split_by_line_content(tmp_path):
    data = rows()
    train, held = read_documents(write(tmp_path / "d.jsonl", data))
    assert sorted(json.dumps(doc) for _, doc in train + held) == sorted(json.dumps(as_document(r)) for r in data)
    assert [where for where, doc in train + held if doc == as_document(data[7])] == [f"{tmp_path / 'd.jsonl'}:8"]
    assert len(held) == 5 and len(train) == 115
    # The split follows each line, not its place: reversed and with blank lines, the same documents.
    again_train, again_held = read_documents(write(tmp_path / "r.jsonl", ["", *reversed(data), ""]))
    documents = lambda numbered: [doc for _, doc in numbered]  # noqa: E731
    assert documents(again_held) == documents(held)[::-1] and documents(again_train) == documents(train)[::-1]


@pytest.mark.parametrize("line, message", [
    ("{'messages': []}", "d.jsonl:2: not valid JSON"),
    (json.dumps({"conversations": [{"from": "robot", "value": "hi"}]}), "d.jsonl:2: ShareGPT roles ['robot'] unknown"),
    (json.dumps({"messages": [{"content": "hi"}]}), "d.jsonl:2: the conversation, message 0: expected a dict"),
    (json.dumps({"prompt": "x"}), "d.jsonl:2: no \"messages\", \"conversations\" or non-empty \"text\" among keys"),
    (json.dumps([1, 2]), "d.jsonl:2: expected a JSON object, got list"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(ValueError) as e:
        read_documents(write(tmp_path / "d.jsonl", [rows(1)[0], line]))
    assert message in str(e.value) and "each line holds one" in str(e.value), e.value


def test_missing_file_and_too_few_lines(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_file '.*none.jsonl' does not exist.*data_file: null"):
        read_documents(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="gives 1 training and 0 held-out documents.*add lines"):
        read_documents(write(tmp_path / "one.jsonl", rows(1)))
    # A folder read as "does not exist"; a Latin-1 file failed without its name.
    with pytest.raises(ValueError, match=f"data_file '{tmp_path}' is a folder: give a JSONL file"):
        read_documents(tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="'.*latin1.jsonl' is not UTF-8 text .* at byte 13.*save it as UTF-8"):
        read_documents(tmp_path / "latin1.jsonl")


def config(folder, tmp_path, data_file, **over) -> dict:
    return {"kind": "medusa", "target": str(folder), "out": str(tmp_path / "heads"), "work_dir": str(tmp_path / "work"),
            "data_file": str(data_file), "threads": 1, "mixed_precision": "no", "num_heads": 2, "seq_len": 32,
            "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "max_steps": 30, "eval_tokens": 128,
            "tree_budget": 4, **over}


def test_conversations_become_template_tokens_and_heads_train_on_them(chat_target, tmp_path):
    folder, tok = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    train_docs, held_docs = read_documents(path)
    cfg = load_config(config(folder, tmp_path, path))
    streams = token_streams(cfg, AutoTokenizer.from_pretrained(folder))
    for stream, docs in zip(streams, (train_docs, held_docs)):
        # Replies included, no turn left open, one BOS per conversation; texts as tokenized plain.
        want = []
        for _, doc in docs:
            want += chatml_ids(tok, doc, open_turn=False) if isinstance(doc, list) else tok(doc)["input_ids"]
            want.append(tok.eos_token_id)
        assert stream.tolist() == want
    metrics = train(cfg)
    assert metrics["curve"][-1][1] < metrics["curve"][0][1]
    assert (tmp_path / "heads" / "config.json").is_file()
    path.write_text(path.read_text().replace("Task 0", "Task zero"))  # an edited file is read again
    assert token_streams(cfg, AutoTokenizer.from_pretrained(folder))[0].tolist() != streams[0].tolist()


def test_data_file_refusals(chat_target, tiny_models, tmp_path):
    folder, _ = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    with pytest.raises(ValueError, match="set either data_file .* or corpus_root"):
        load_config(config(folder, tmp_path, path, corpus_root=str(tmp_path)))
    plain = tiny_models["llama"][0]  # its tokenizer has no chat template
    with pytest.raises(ValueError, match="has no chat template"):
        token_streams(load_config(config(plain, tmp_path, path)), AutoTokenizer.from_pretrained(plain))
    with pytest.raises(ValueError, match="the heldout split has .* tokens, no more than seq_len 4096: add documents"):
        token_streams(load_config(config(folder, tmp_path, path, seq_len=4096)), AutoTokenizer.from_pretrained(folder))


def test_the_vocab_command_counts_on_a_data_file(chat_target, tmp_path, capsys):
    """`draftsman vocab --data-file`: the target's picks counted on the rendered conversations'
    training split (the same stream heads training reads), every token once."""
    folder, tok = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    out = tmp_path / "order.json"
    args = ["vocab", "--target", str(folder), "--out", str(out), "--data-file", str(path), "--work-dir",
            str(tmp_path / "work"), "--tokens", "512", "--seq-len", "32", "--threads", "1"]
    assert cli.main(args) == 0 and "coverage" in capsys.readouterr().out
    written = json.loads(out.read_text())["tokens_by_frequency"]
    assert sorted(written) == list(range(len(tok)))
    cfg = load_config(config(folder, tmp_path, path, eval_tokens=512))
    stream = token_streams(cfg, AutoTokenizer.from_pretrained(folder))[0]
    reference, autocast = reference_where_the_cli_counts(folder)
    assert written == target_token_frequencies(cfg, reference, stream, autocast)["order"]
    assert cli.main([*args, "--corpus-root", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_conversation_the_template_refuses_is_named_by_its_line(chat_target, tmp_path):
    """Gemma's template refuses a system message; Llama 2's, turns that do not alternate. The
    refusal comes while tokenizing, long after reading: it still names the line."""
    folder = shutil.copytree(chat_target[0], tmp_path / "no-system")
    template = folder / "chat_template.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}" + template.read_text())
    path = write(tmp_path / "chat.jsonl", rows())
    first_system = next(n for n, r in enumerate(rows(), 1) if "conversations" in r)
    with pytest.raises(ValueError) as e:
        token_streams(load_config(config(folder, tmp_path, path)), AutoTokenizer.from_pretrained(folder))
    assert "refused the conversation: System role not supported" in str(e.value)
    assert str(e.value).startswith(f"{path}:") and int(str(e.value).split(":")[1]) % 3 == first_system % 3
