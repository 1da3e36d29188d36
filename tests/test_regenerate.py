"""`draftsman regenerate`: a data_file's assistant replies written again by the target itself,
turn by turn, through speculative decoding; resumable."""
import json

import pytest

import draftsman
from draftsman import cli
from draftsman.training.regenerate import without_cut_character

NEW = 8
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "run", "arguments": {"code": "x"}}}]}
LINES = [
    {"messages": [{"role": "user", "content": "def parse(text):"}, {"role": "assistant", "content": "pass"},
                  {"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "for i in range(3):"},
                       {"from": "gpt", "value": "print(i)"}]},
    {"text": "x = 1\n"},
    {"messages": [{"role": "user", "content": "run x"}, CALL, {"role": "tool", "content": "1"},
                  {"role": "assistant", "content": "done"}]},
    {"messages": [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "a = ["},
                  {"role": "assistant", "content": "1]"}]},
]


def replayed(folder) -> tuple[list[dict], int]:
    """What regeneration must write, computed one conversation and one turn at a time by plain
    decoding (no drafter, no batch), and how many replies max_new_tokens cut."""
    dec = draftsman.load({"target": {"path": str(folder)}})
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    out, cut = [], 0
    for line in LINES:
        if "text" in line:
            out.append(line)
            continue
        messages = line.get("messages") or [{"role": roles[t["from"]], "content": t["value"]}
                                            for t in line["conversations"]]
        messages = [dict(m) for m in messages]
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and i > 0 and not m.get("tool_calls"):
                reply = dec.chat(messages[:i], max_new_tokens=NEW)
                messages[i]["content"] = reply.texts[0]
                cut += reply.stats.finish_reasons[0] == "length"
        out.append({"messages": messages})
    return out, cut


def write(path, lines):
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_replies_are_the_targets_own_turn_by_turn(chat_target, tmp_path, capsys):
    folder, _ = chat_target
    data = write(tmp_path / "in.jsonl", LINES)
    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--target", str(folder), "--data-file", str(data), "--out", str(out),
            "--drafter", "ngram", "--set", "drafter.min_ngram=1", "--max-new-tokens", str(NEW), "--batch-size", "2"]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want, cut = replayed(folder)
    assert [json.loads(line) for line in out.read_text().splitlines()] == want
    assert want[0]["messages"][1]["content"] != "pass"  # replaced, and then answered after
    assert summary["lines"] == 5 and summary["replies"] == 5 and summary["kept_as_given"] == 2
    assert summary["resumed_after_lines"] == 0
    assert summary["cut_at_max_new_tokens"] == cut


def test_a_stopped_run_resumes_after_its_last_whole_line(chat_target, tmp_path, capsys):
    folder, _ = chat_target
    data = write(tmp_path / "in.jsonl", LINES)
    base = ["regenerate", "--target", str(folder), "--data-file", str(data), "--max-new-tokens", str(NEW)]
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    assert cli.main([*base, "--out", str(whole)]) == 0
    assert cli.main([*base, "--out", str(part), "--limit", "2"]) == 0
    assert len(part.read_text().splitlines()) == 2
    with part.open("a") as f:
        f.write('{"messages": [{"ro')  # killed mid-line
    assert cli.main([*base, "--out", str(part)]) == 0
    assert part.read_text() == whole.read_text()
    capsys.readouterr()
    assert cli.main([*base, "--out", str(part), "--limit", "3"]) == 2
    assert "already holds 5 lines, more than the 3 to write" in capsys.readouterr().err


def test_a_resume_with_other_settings_is_refused_naming_both(chat_target, tmp_path, capsys):
    """--max-new-tokens and sampling are recorded beside --out; a resume with others mixed 8-token and
    2-token (or greedy and sampled) replies silently. An output from before the record still resumes.
    The summary counts the file's lines and says what this run added."""
    folder, _ = chat_target
    data = write(tmp_path / "in.jsonl", LINES)
    out = tmp_path / "out.jsonl"
    base = ["regenerate", "--target", str(folder), "--data-file", str(data), "--out", str(out)]
    assert cli.main([*base, "--max-new-tokens", str(NEW), "--limit", "2"]) == 0
    record = json.loads((tmp_path / "out.jsonl.settings.json").read_text())
    assert record["max_new_tokens"] == NEW and record["sampling"]["temperature"] == 0.0
    capsys.readouterr()
    written = out.read_bytes()
    sampled = ["--max-new-tokens", str(NEW), "--set", "sampling.temperature=0.7"]
    for change, message in ((["--max-new-tokens", "2"], "max_new_tokens: 8 then, 2 now"),
                            (sampled, "'temperature': 0.7")):
        assert cli.main([*base, *change]) == 2
        err = capsys.readouterr().err
        assert f"--out '{out}' was written with other settings (" in err and message in err, err
        assert "Rerun with the same settings, or give a new --out" in err
    assert out.read_bytes() == written
    assert cli.main([*base, "--max-new-tokens", str(NEW), "--limit", "3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["lines"] == 3 and summary["resumed_after_lines"] == 2
    (tmp_path / "out.jsonl.settings.json").unlink()  # as an older version left it
    assert cli.main([*base, "--max-new-tokens", "2", "--limit", "4"]) == 0
    assert "has no out.jsonl.settings.json" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl.settings.json").exists()


@pytest.mark.parametrize("lines, args, message", [
    ([LINES[0], {"messages": []}], [], "in.jsonl:2: the conversation is []"),
    (LINES, ["--out", "SAME"], "--out must be another file than --data-file"),
    (LINES, ["--batch-size", "0"], "--batch-size and --max-new-tokens must be at least 1"),
    (LINES, ["--limit", "-1"], "--limit must be at least 1 (input lines to regenerate), got -1"),  # ran all but one
    (LINES, ["--out", "FOLDER"], "is a folder: give the JSONL file to write"),  # was "[Errno 21] Is a directory"
    # Anything but earlier output at --out was resumed: appended to, and its last line cut if it had no newline.
    (LINES, ["--out", "NOTES"], "line 1 is no line regenerate writes"),
    (LINES, ["--out", "ONE-LINE"], "line 1 is no line regenerate writes"),
    (LINES, ["--out", "OTHER-JSON"], "line 1 is not the output of --data-file's line 1"),
    (LINES, ["--out", "LONGER"], "already holds 6 lines, more than the 5 to write"),
    # Another dataset in regenerate's own form was resumed: its lines counted as done, its last line cut.
    (LINES, ["--out", "OTHER-DATASET"], "line 1 is not the output of --data-file's line 1 (its conversation"),
    (LINES, ["--out", "EDITED-INPUT"], "line 2 is not the output of --data-file's line 2"),
    ([], [], "in.jsonl' holds no lines: give a JSONL file"),  # loaded the target, wrote nothing, exit 0
    (LINES, ["--data-file", "MISSING"], "missing.jsonl' does not exist: give a JSONL file with one"),
])
def test_refusals_come_before_any_model_loads(tmp_path, capsys, lines, args, message):
    data = write(tmp_path / "in.jsonl", lines)
    files = {"FOLDER": tmp_path, "NOTES": tmp_path / "notes.txt", "ONE-LINE": tmp_path / "one.txt",
             "MISSING": tmp_path / "missing.jsonl",
             "OTHER-JSON": tmp_path / "other.jsonl", "LONGER": tmp_path / "longer.jsonl",
             "OTHER-DATASET": tmp_path / "dataset.jsonl", "EDITED-INPUT": tmp_path / "edited.jsonl"}
    other = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer"}]}
             for i in range(3)]
    files["OTHER-DATASET"].write_text("\n".join(json.dumps(r) for r in other))  # no final newline
    first = {"messages": [dict(m, content="a reply of its own") if m["role"] == "assistant" else m
                          for m in LINES[0]["messages"]]}  # line 1 regenerated; line 2 asked another question
    second = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "for i in range(4):"},
                           {"role": "assistant", "content": "a reply of its own"}]}
    files["EDITED-INPUT"].write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    files["NOTES"].write_text("my notes\nthe last line, no newline")
    files["ONE-LINE"].write_text("one line, no newline")
    files["OTHER-JSON"].write_text('{"text": "a"}\n{"model_type": "llama"}\n[1, 2]\n')
    write(files["LONGER"], [{"text": "x"}] * 6)
    before = {path: path.read_bytes() for path in files.values() if path.is_file()}
    args = [str(data) if a == "SAME" else str(files[a]) if a in files else a for a in args]
    base = ["regenerate", "--target", "/no/such/model"] + ([] if "--data-file" in args else ["--data-file", str(data)])
    assert cli.main([*base, *([] if "--out" in args else ["--out", str(tmp_path / "o.jsonl")]), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert "data_file: null" not in err  # (the training key's advice)
    assert {path: path.read_bytes() for path in before} == before


def test_a_conversation_past_the_context_keeps_its_reply(chat_target, tmp_path, capsys):
    """No room to answer (the conversation so far fills the target's 256 positions): that reply is
    kept as given and counted; the other rows of the batch are still written again."""
    folder, _ = chat_target
    long = {"messages": [{"role": "user", "content": "x = 1\n" * 200}, {"role": "assistant", "content": "ok"}]}
    data = write(tmp_path / "in.jsonl", [long, LINES[0]])
    out = tmp_path / "out.jsonl"
    assert cli.main(["regenerate", "--target", str(folder), "--data-file", str(data), "--out", str(out),
                     "--max-new-tokens", str(NEW)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kept_past_context"] == 1 and summary["replies"] == 2
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[0] == long and written[1] == replayed(folder)[0][0]


def test_a_target_without_a_chat_template_is_named_before_out_is_written(tiny_models, tmp_path, capsys):
    """Conversations need the target's chat template: without one the run stops before --out is
    created (it left an empty file behind); plain text lines need none."""
    folder, _ = tiny_models["llama"]
    out = tmp_path / "out.jsonl"

    def regenerate(lines):
        data = write(tmp_path / "in.jsonl", lines)
        return cli.main(["regenerate", "--target", str(folder), "--data-file", str(data), "--out", str(out),
                         "--max-new-tokens", "2"])
    assert regenerate(LINES[:1]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not out.exists()
    assert regenerate([{"text": "x = 1\n"}]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"text": "x = 1\n"}]


def test_a_reply_cut_inside_a_character_drops_the_cut_characters_tokens(chat_target):
    """A cut "é" (two byte tokens here) decodes to U+FFFD; the reply keeps only whole characters."""
    tok = chat_target[1]
    ids = tok.encode("ab é", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    assert without_cut_character(tok.decode, ids[:-1], tok.decode(ids[:-1])) == "ab "
    assert without_cut_character(tok.decode, ids, tok.decode(ids)) == "ab é"  # whole: kept


def test_regenerate_writes_whole_characters_only(chat_target, tmp_path, capsys):
    """Replies pushed to the first byte of "é" and cut there (logit_bias, 1 new token): nothing of it is written."""
    folder, tok = chat_target
    first_byte = tok.encode("é", add_special_tokens=False)[0]
    out = tmp_path / "out.jsonl"
    args = ["regenerate", "--target", str(folder), "--data-file", str(write(tmp_path / "in.jsonl", LINES[:2])),
            "--out", str(out), "--max-new-tokens", "1", "--set", f"sampling.logit_bias={{{first_byte}: 100}}"]
    assert cli.main(args) == 0
    replies = [m["content"] for line in out.read_text().splitlines() for m in json.loads(line)["messages"]
               if m["role"] == "assistant" and m.get("content") is not None]
    assert "" in replies and not any("\ufffd" in reply for reply in replies), replies
