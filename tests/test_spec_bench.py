"""Spec-Bench's question.jsonl as a prompt file: one prompt per user turn, later turns carrying the
target's own greedy replies to the earlier ones (written once, before any timing), MT-bench's eight
categories reported as the one task "mt_bench"; audit takes each question's first turn."""
import json

import pytest
import yaml

import draftsman
from draftsman import audit, cli
from draftsman.bench import prompts_set as P
from draftsman.training.regenerate import without_cut_character

NEW = 10
QUESTIONS = [  # Spec-Bench's own row shape
    {"question_id": 81, "category": "writing", "turns": ["def parse(text):", "import os", "for i in range(10):"]},
    {"question_id": 101, "category": "translation", "turns": ["class Foo:"]},
    {"question_id": 82, "category": "coding", "turns": ["import sys", "def main():"]},
]


def write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def user(text):
    return {"role": "user", "content": text}


def test_rows_give_one_prompt_per_turn_grouped_as_spec_bench_tasks(tmp_path):
    prompts, _ = P.read_prompts(write(tmp_path / "question.jsonl", QUESTIONS))
    assert [(p.id, p.category, p.source) for p in prompts] == [
        ("81", "mt_bench", "writing"), ("81-turn2", "mt_bench", "writing"), ("81-turn3", "mt_bench", "writing"),
        ("101", "translation", "translation"), ("82", "mt_bench", "coding"), ("82-turn2", "mt_bench", "coding")]
    assert [p.turns for p in prompts[:3]] == [QUESTIONS[0]["turns"][:k] for k in (1, 2, 3)]
    assert prompts[0].messages == [user("def parse(text):")]  # a first turn needs no reply
    assert prompts[1].messages is None and prompts[2].messages is None  # written by answer_earlier_turns
    assert list(P.by_category(prompts, per_category=2)) == ["mt_bench", "translation"]


@pytest.mark.parametrize("row, message", [
    ({"question_id": 1, "turns": []}, '"turns" must be a non-empty list'),
    ({"question_id": 1, "turns": "hello"}, '"turns" must be a non-empty list'),
    ({"question_id": 1, "turns": ["a", 3]}, '"turns" must be a non-empty list'),
    ({"question_id": 1, "turns": ["a"], "text": "b"}, "a prompt has \"turns\" or 'text', not both"),
    ({"question_id": 1, "turns": ["a"], "messages": [user("b")]}, "a prompt has \"turns\" or 'messages', not both"),
    ({"turns": ["a"]}, 'a "turns" row needs its "question_id"'),
])
def test_bad_rows_are_named_by_line(tmp_path, row, message):
    path = write(tmp_path / "q.jsonl", [QUESTIONS[1], row])
    with pytest.raises(ValueError, match="q.jsonl:2: " + message.replace("(", r"\(").replace(")", r"\)")):
        P.read_prompts(path)


def test_a_question_id_used_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="q.jsonl:2: prompt id '101' is used twice"):
        P.read_prompts(write(tmp_path / "q.jsonl", [QUESTIONS[1], QUESTIONS[1]]))


def test_later_turns_carry_the_targets_greedy_replies(chat_target, tmp_path):
    """Each later turn's conversation is what a turn-by-turn replay gives: the target's greedy reply
    to each earlier turn (dec.chat at temperature 0, a cut one ending before a cut character, as
    `draftsman regenerate` writes it), one replay per question."""
    folder, _ = chat_target
    dec = draftsman.load({"target": {"path": str(folder)}, "sampling": {"temperature": 1.0}})
    prompts, _ = P.read_prompts(write(tmp_path / "question.jsonl", QUESTIONS))
    assert P.answer_earlier_turns(dec, prompts, NEW) == 3  # 81: turns 1 and 2; 82: turn 1

    for question in (QUESTIONS[0], QUESTIONS[2]):
        expected = []
        for k, turn in enumerate(question["turns"], 1):
            expected.append(user(turn))
            got = next(p for p in prompts if p.id == (str(question["question_id"]) + (f"-turn{k}" if k > 1 else "")))
            assert got.messages == expected
            out = dec.chat(expected, max_new_tokens=NEW, temperature=0)
            reply = out.texts[0]
            if out.stats.finish_reasons[0] == "length":  # cut: no part of a character (regenerate's replies)
                reply = without_cut_character(dec.decode, out.token_ids[0], reply)
            expected = expected + [{"role": "assistant", "content": reply}]
    assert any(p.messages[1]["content"] for p in prompts if p.id.endswith("-turn2"))  # not all replies are empty


def test_compare_times_every_turn_of_a_spec_bench_file(chat_target, tmp_path, capsys):
    folder, _ = chat_target
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump({
        "target": {"path": str(folder)}, "drafters": [{"name": "none"}, {"name": "ngram", "k": 3}],
        "prompts": str(write(tmp_path / "question.jsonl", QUESTIONS)), "peers": False,
        "temperatures": [0], "out": str(tmp_path / "out")}))
    assert cli.main(["compare", "--config", str(tmp_path / "bench.yaml"), "--quick", "--no-progress"]) == 0
    capsys.readouterr()
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["prompts"]["counts"] == {"mt_bench": 2, "translation": 1}  # --quick: the first 2 of each task
    cells = {(c["drafter"], c["category"]): c for c in res["cells"]}
    assert set(cells) == {(d, c) for d in ("none", "ngram") for c in ("mt_bench", "translation")}
    assert all(c["mismatches"] == 0 and not c["divergences"] for c in cells.values())


def test_audit_takes_each_questions_first_turn(chat_target, tmp_path):
    folder, tok = chat_target
    prompts = audit.read_prompts(write(tmp_path / "question.jsonl", QUESTIONS))
    assert prompts == [[user(q["turns"][0])] for q in QUESTIONS]
    dec = draftsman.load({"target": {"path": str(folder)}})
    assert audit.encode_prompts(dec, prompts)[1] == dec.encode_chat([user("class Foo:")])[0]
