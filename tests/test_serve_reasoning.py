"""Reasoning apart from the answer (`draftsman serve --reasoning-parser qwen3|deepseek_r1|mistral`,
draftsman/reasoning.py): whole replies and streamed ones split as vLLM's parsers split them,
alone and with tool calls after the thought. The tiny target writes no thought of its own, so the
answer's shaping is tested on replies the server's batcher is made to return (as
test_serve_tool_calls.py does), and the real path on the tiny target's own replies."""
import random

import pytest

from draftsman.reasoning import ReasoningStream, prompt_opens_thought, split_reasoning
from serving import call, events, ngram_decoder, running
from test_serve_tool_calls import TOOLS, USER, calls_of, replying, tool_server  # noqa: F401 (a fixture)

CASES = {  # parser, reply -> (reasoning, answer)
    ("qwen3", "<think>\nWeigh it.\n</think>\n\nParis."): ("\nWeigh it.\n", "\n\nParis."),
    ("qwen3", "Paris."): (None, "Paris."),  # thinking off: no thought
    ("qwen3", "<think>\n\n</think>\n\nParis."): ("\n\n", "\n\nParis."),
    ("qwen3", "<think>cut off"): (None, "<think>cut off"),  # no closed thought: all answer
    ("qwen3", "Sure. <think>x</think>Paris."): ("x", "Sure. Paris."),  # text before the thought is answer
    ("deepseek_r1", "Weigh it.\n</think>\n\nParis."): ("Weigh it.\n", "\n\nParis."),  # <think> was in the prompt
    ("deepseek_r1", "<think>Weigh it.</think>Paris."): ("Weigh it.", "Paris."),
    ("deepseek_r1", "still thinking"): ("still thinking", None),  # cut off while thinking
    ("deepseek_r1", "</think>Paris."): (None, "Paris."),
    ("mistral", "[THINK]Weigh it.[/THINK]Paris."): ("Weigh it.", "Paris."),  # Magistral's special tokens, kept
    ("mistral", "Paris."): (None, "Paris."),
    ("mistral", "[THINK]cut off"): ("cut off", None),  # unlike qwen3: a special tag opens a thought for sure
    ("mistral", "Sure. [THINK]x[/THINK]Paris."): ("x", "Sure. Paris."),
    ("mistral", "<think>x</think>Paris."): (None, "<think>x</think>Paris."),  # Qwen's tags are text to it
}
# The prompt opened the thought (a template that ends the prompt in <think>): either parser starts inside it.
OPENED = {
    ("qwen3", "Weigh it.\n</think>\n\nParis."): ("Weigh it.\n", "\n\nParis."),
    ("qwen3", "still thinking"): ("still thinking", None),
    ("qwen3", "<think>Weigh it.</think>Paris."): ("Weigh it.", "Paris."),
    ("deepseek_r1", "Weigh it.</think>Paris."): ("Weigh it.", "Paris."),
    ("mistral", "Weigh it.[/THINK]Paris."): ("Weigh it.", "Paris."),
}


@pytest.mark.parametrize("parser, text", list(CASES))
def test_a_reply_is_split_into_reasoning_and_answer(parser, text):
    assert split_reasoning(text, parser) == CASES[parser, text]


@pytest.mark.parametrize("parser, text", list(OPENED))
def test_a_reply_to_a_prompt_that_opened_the_thought_starts_inside_it(parser, text):
    assert split_reasoning(text, parser, opened=True) == OPENED[parser, text]


def test_a_prompt_opens_the_thought_when_it_ends_in_the_tag():
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not prompt_opens_thought("<|im_start|>assistant\n") and not prompt_opens_thought("")
    assert prompt_opens_thought("[INST]Why?[/INST][THINK]", "mistral")
    assert not prompt_opens_thought("[INST]Why?[/INST][THINK]") and not prompt_opens_thought("<think>", "mistral")


# (A qwen3 thought that never closes streams as reasoning: tested below.)
STREAMED = [(*case, False) for case in CASES if case != ("qwen3", "<think>cut off")] + [(*c, True) for c in OPENED]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("parser, text, opened", STREAMED)
def test_a_streamed_reply_gives_what_the_whole_reply_gives(parser, text, opened, seed):
    """The reply cut into random pieces (cuts inside the tags too) joins to the whole reply's
    parts. (A qwen3 thought that never closes streams as reasoning: tested below.)"""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 8))))
    stream, deltas = ReasoningStream(parser, opened), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.finish()
    assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)  # one non-empty part each
    joined = tuple("".join(d.get(key, "") for d in deltas) or None for key in ("reasoning_content", "content"))
    assert joined == (OPENED if opened else CASES)[parser, text]


def test_an_unclosed_qwen3_thought_streams_as_reasoning():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi") == [] and stream.feed("nk>cut") == [{"reasoning_content": "cut"}]
    assert stream.feed(" off</th") == [{"reasoning_content": " off"}]
    assert stream.finish() == [{"reasoning_content": "</th"}]


THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"


@pytest.fixture(scope="module")
def thinking_server(tool_server):  # noqa: F811
    """The tool-reading target (test_serve_tool_calls.py) served with both parsers."""
    server, _ = tool_server
    with running(ngram_decoder(server.decoder.config["target"]["path"]), tool_call_parser="hermes",
                 reasoning_parser="qwen3") as served:
        yield served


def test_a_reply_with_a_thought_and_calls(thinking_server, monkeypatch):
    from test_serve_tool_calls import CONTENT, REPLY

    server, base = thinking_server
    replying(server, monkeypatch, THOUGHT + REPLY)
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    message = got["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] == "\nThe user wants the weather.\n"
    assert message["content"] == "\n\n" + CONTENT and len(message["tool_calls"]) == 2  # after </think>, as written
    assert got["choices"][0]["finish_reason"] == "tool_calls"
    streamed = events(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in streamed]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user wants the weather.\n"
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert len(calls_of([d["tool_calls"][0] for d in deltas if "tool_calls" in d])) == 2
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_reply_without_a_thought_is_all_answer(thinking_server, monkeypatch):
    server, base = thinking_server
    replying(server, monkeypatch, "Paris. <thi")  # its end might have opened a thought
    status, got = call(base, "/v1/chat/completions", {"messages": USER})
    assert status == 200 and got["choices"][0]["message"] == {"role": "assistant", "content": "Paris. <thi",
                                                              "reasoning_content": None}
    streamed = events(base, "/v1/chat/completions", {"messages": USER, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in streamed]
    assert "".join(d.get("content", "") for d in deltas) == "Paris. <thi"
    assert not any("reasoning_content" in d for d in deltas)


def test_a_prompt_that_ended_the_thought_streams_what_the_whole_reply_gives(thinking_server, monkeypatch):
    """The prompt closed the thought (as enable_thinking false's empty <think></think> does, here an
    assistant prefill): the reply is all answer, a <think> inside it too. The stream sent the text
    after that <think> as reasoning, where the whole reply kept it as content."""
    server, base = thinking_server
    reply = '{"c": "a<think>b"} and <think>more</think> after'
    replying(server, monkeypatch, reply)
    body = {"messages": USER + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
            "add_generation_prompt": False, "continue_final_message": True}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200 and got["choices"][0]["message"] == {"role": "assistant", "content": reply,
                                                              "reasoning_content": None}
    deltas = [e["choices"][0]["delta"] for e in events(base, "/v1/chat/completions", {**body, "stream": True})]
    assert "".join(d.get("content") or "" for d in deltas) == reply
    assert not any(d.get("reasoning_content") for d in deltas)


def test_completions_are_not_split(thinking_server, monkeypatch):
    """/v1/completions returns text as it is: a prompt's own format is the client's to read."""
    server, base = thinking_server
    replying(server, monkeypatch, THOUGHT + "Paris.")
    status, got = call(base, "/v1/completions", {"prompt": "a"})
    assert status == 200 and got["choices"][0]["text"] == THOUGHT + "Paris."


def test_the_tiny_targets_own_reply(thinking_server):
    _, base = thinking_server
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0})
    message = got["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] is None and isinstance(message["content"], str)


def test_the_parser_is_checked_when_the_server_starts(chat_target):
    from draftsman.serve import Server

    with pytest.raises(ValueError, match="--reasoning-parser 'r1' is not known; the parsers are: qwen3, deepseek_r1"):
        Server(ngram_decoder(chat_target[0]), "tiny", "127.0.0.1", 0, reasoning_parser="r1")


def test_include_reasoning_false_leaves_the_thought_out(thinking_server, monkeypatch):
    """vLLM's "include_reasoning": false: the answer as with the parser, the thought dropped."""
    from test_serve_tool_calls import CONTENT, REPLY

    server, base = thinking_server
    replying(server, monkeypatch, THOUGHT + REPLY)
    body = {"messages": USER, "tools": TOOLS, "include_reasoning": False}
    status, got = call(base, "/v1/chat/completions", body)
    message = got["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] is None and message["content"] == "\n\n" + CONTENT
    assert len(message["tool_calls"]) == 2
    deltas = [e["choices"][0]["delta"] for e in events(base, "/v1/chat/completions", {**body, "stream": True})]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    status, got = call(base, "/v1/chat/completions", {**body, "include_reasoning": True})
    assert got["choices"][0]["message"]["reasoning_content"] == "\nThe user wants the weather.\n"
    status, got = call(base, "/v1/chat/completions", {**body, "include_reasoning": "no"})
    assert status == 400 and '"include_reasoning" must be true or false' in got["error"]["message"]
