"""`draftsman chat`: each reply is what Decoder.chat gives for the conversation so far (earlier
replies included), /reset forgets all but the system message, a turn that fails leaves the
conversation as it was, and a target without a chat template is refused before any input."""
import io
import json
import sys

import pytest

import draftsman
from draftsman import cli
from draftsman.interactive import converse

NEW = 10
SYSTEM = [{"role": "system", "content": "Be brief."}]


@pytest.fixture(scope="module")
def decoder(chat_target):
    folder, _ = chat_target
    return draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})


def user(text):
    return {"role": "user", "content": text}


def test_replies_follow_the_conversation_and_reset_forgets_it(decoder, capsys):
    lines = io.StringIO("def parse(text):\nimport os\n/reset\nclass Foo:\n")
    end = converse(decoder, lines, SYSTEM, max_new_tokens=NEW)
    out = capsys.readouterr()

    first = decoder.chat(SYSTEM + [user("def parse(text):")], max_new_tokens=NEW).texts[0]
    second = decoder.chat(SYSTEM + [user("def parse(text):"), {"role": "assistant", "content": first},
                                    user("import os")], max_new_tokens=NEW).texts[0]
    third = decoder.chat(SYSTEM + [user("class Foo:")], max_new_tokens=NEW).texts[0]
    assert out.out == f"{first}\n{second}\n{third}\n"  # streamed pieces join to each whole reply
    assert end == SYSTEM + [user("class Foo:"), {"role": "assistant", "content": third}]
    assert out.err.count("[tau ") == 3 and "(conversation reset)" in out.err


def test_a_failed_turn_keeps_the_conversation_and_exit_stops(decoder, capsys):
    too_long = "x " * 5000
    end = converse(decoder, io.StringIO(f"import os\n{too_long}\n/exit\nnever read\n"), [], max_new_tokens=NEW)
    err = capsys.readouterr().err
    assert "error: prompt 0 has" in err and "(/reset starts over)" in err
    assert [m["content"] for m in end if m["role"] == "user"] == ["import os"]


def test_the_command_runs_on_stdin_and_refuses_a_target_without_a_template(chat_target, tiny_models, tmp_path,
                                                                          monkeypatch, capsys):
    folder, _ = chat_target
    config = tmp_path / "chat.json"
    config.write_text(json.dumps({"target": {"path": str(folder)}, "drafter": {"name": "ngram"}}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("def parse(text):\n"))
    assert cli.main(["chat", "--config", str(config), "--max-new-tokens", str(NEW), "--system", "Be brief."]) == 0
    dec = draftsman.load(str(config))
    want = dec.chat(SYSTEM + [user("def parse(text):")], max_new_tokens=NEW).texts[0]
    assert capsys.readouterr().out == want + "\n"

    plain_target, _ = tiny_models["llama"]
    assert cli.main(["chat", "--set", f"target.path={plain_target}"]) == 2
    assert "has no chat template" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: generation.max_new_tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "--temperature -1.0: sampling.temperature must be >= 0"),
    (["--max-new-tokens", "4", "--set", "generation.min_new_tokens=8"],
     "--max-new-tokens 4: generation.min_new_tokens must be in [0, max_new_tokens = 4], got 8")],
    ids=["max-new-tokens-0", "negative-temperature", "below-min-new-tokens"])
def test_a_generation_flag_no_reply_could_use_is_refused_before_the_model_loads(chat_target, monkeypatch, capsys,
                                                                                 flags, named):
    """Such a flag reached the decoder on every turn: each message printed the same error, which
    /reset could not help, and the chat exited 0."""
    import draftsman.api

    class NeverRead:
        def readline(self):
            raise AssertionError("input was read")

    def no_load(cfg):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(sys, "stdin", NeverRead())
    monkeypatch.setattr(draftsman.api, "Decoder", no_load)
    assert cli.main(["chat", "--target", str(chat_target[0]), *flags]) == 2
    assert named in capsys.readouterr().err


def test_commands_are_not_sent_as_messages(decoder, capsys):
    """/help, /nosuch and the usual aliases were sent to the model as user messages."""
    lines = io.StringIO("import os\n/help\n/nosuch\n/CLEAR\nclass Foo:\n/usr is a folder\n/usr/bin/env\n/quit\nnever "
                        "read\n")
    end = converse(decoder, lines, [], max_new_tokens=NEW)
    err = capsys.readouterr().err
    assert "(commands: /reset" in err and "(unknown command /nosuch; commands: /reset" in err
    assert "(conversation reset)" in err and err.count("[tau ") == 4
    assert [m["content"] for m in end if m["role"] == "user"] == ["class Foo:", "/usr is a folder", "/usr/bin/env"]


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on_as_if_it_were_never_asked(chat_target, capsys, monkeypatch):
    """Ctrl-C ended the whole chat; now it ends the reply, which the conversation leaves out. The
    drafter here keeps state (a draft model's KV cache) that the stopped reply must not leak."""
    folder, _ = chat_target
    stateful = draftsman.load({"target": {"path": str(folder)},
                               "drafter": {"name": "draft_model", "path": str(folder), "k": 3}})
    real, calls = type(stateful.drafter).propose, [0]

    def interrupted_at_the_third_round(self, contexts):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(self, contexts)

    monkeypatch.setattr(type(stateful.drafter), "propose", interrupted_at_the_third_round)
    end = converse(stateful, io.StringIO("import os\ndef parse(text):\n"), SYSTEM, max_new_tokens=NEW)
    monkeypatch.undo()
    out = capsys.readouterr()
    assert "(reply stopped; the conversation leaves it out)" in out.err and out.err.count("[tau ") == 1
    want = stateful.chat(SYSTEM + [user("def parse(text):")], max_new_tokens=NEW).texts[0]
    assert end == SYSTEM + [user("def parse(text):"), {"role": "assistant", "content": want}]
    assert out.out.endswith(want + "\n")

    class CtrlCAtThePrompt:
        def readline(self):
            raise KeyboardInterrupt

    assert converse(stateful, CtrlCAtThePrompt(), SYSTEM) == SYSTEM  # quits, as end of input does
