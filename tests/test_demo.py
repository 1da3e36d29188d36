"""`draftsman demo` (draftsman/demo.py): its flags are checked before any model loads."""
from __future__ import annotations

import pytest

from draftsman import cli, demo
from draftsman.prompts import heldout_prompts


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "0"], "--prompts must be an integer >= 1, got 0"),  # it ran all 69 held-out prompts
    (["--prompts", "-3"], "--prompts must be an integer >= 1, got -3"),
    (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),  # "no median for empty data", after loading
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
])
def test_bad_flags_are_named_before_the_models_load(flags, message, monkeypatch, capsys):
    def loads(*args):
        raise AssertionError("the models loaded before the flags were checked")

    monkeypatch.setattr(demo, "run", loads)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_heldout_prompts_refuses_a_count_below_one(tmp_path):
    """Its loop stopped only at len == count: count 0 read every file and returned them all."""
    (tmp_path / "a.py").write_text("x = 1\n" * 50)

    def characters(text):  # a tokenizer of one token per character
        return {"input_ids": [ord(c) for c in text]}

    assert len(heldout_prompts(characters, 1, prompt_tokens=8, files=[tmp_path / "a.py"])) == 1
    for count in (0, -1):
        with pytest.raises(ValueError, match=f"count must be >= 1 held-out prompt, got {count}"):
            heldout_prompts(characters, count, prompt_tokens=8, files=[tmp_path / "a.py"])
