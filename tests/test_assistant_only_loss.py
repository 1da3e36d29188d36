"""assistant_only_loss: heads trained on a data_file learn only where the next token belongs to an
assistant's reply. The reply mask, its alignment with the token stream and the training windows,
and the losses and evaluations that honour it."""
import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from draftsman import cli
from draftsman.chat import whole_conversation_ids, whole_conversation_reply_mask
from draftsman.training import heads as H
from draftsman.training.documents import read_documents
from draftsman.training.eagle3 import aux_target_pass, evaluate_eagle3
from draftsman.training.feature_heads import evaluate_feature_head, tokens_by_frequency

from test_training_documents import config, rows, write
from tiny_models import CHATML, load_for_reference, reference_where_the_cli_counts

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Task one"},
                {"role": "assistant", "content": "def f(x): return x"}, {"role": "user", "content": "Task two"},
                {"role": "assistant", "content": "y = 2"}]


def by_hand(tok, conversation, newline_in_reply: bool = True) -> tuple[list[int], list[int]]:
    """CHATML's ids written out turn by turn, and 1 on each reply's own text and end-of-turn marker
    (and the newline after it, when the template writes it inside the reply)."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, mask = [tok.bos_token_id], [0]
    for m in conversation:
        reply = int(m["role"] == "assistant")
        head, body, newline = [start, *text(f"{m['role']}\n")], [*text(m["content"]), end], text("\n")
        ids += head + body + newline
        mask += [0] * len(head) + [reply] * len(body) + [reply if newline_in_reply else 0] * len(newline)
    return ids, mask


def test_reply_mask_marks_each_reply_and_nothing_else(chat_target):
    folder, tok = chat_target
    ids, mask = whole_conversation_reply_mask(tok, CONVERSATION, str(folder))
    assert (ids, mask) == by_hand(tok, CONVERSATION)
    assert ids == whole_conversation_ids(tok, CONVERSATION, str(folder))
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "def f(x): return x<|im_end|>\ny = 2<|im_end|>\n"


def test_a_template_with_generation_markers_marks_its_own_replies(chat_target, tmp_path):
    """HF's {% generation %} markers: the template says where a reply is (here without the newline)."""
    folder = shutil.copytree(chat_target[0], tmp_path / "marked")
    marked = CHATML.replace("{{ m['content'] }}<|im_end|>\n", "{% if m['role'] == 'assistant' %}{% generation %}"
                            "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>"
                            "{% endif %}{{ '\\n' }}")
    assert marked != CHATML
    (folder / "chat_template.jinja").write_text(marked)
    tok = AutoTokenizer.from_pretrained(folder)
    ids, mask = whole_conversation_reply_mask(tok, CONVERSATION, str(folder))
    assert (ids, mask) == by_hand(tok, CONVERSATION, newline_in_reply=False)


def test_a_template_that_rewrites_earlier_turns_is_refused_by_line(chat_target, tmp_path):
    """Like Qwen3's template dropping earlier reasoning: a reply rendered differently once later turns
    follow cannot be located, so it is refused, naming the data_file line and the fix."""
    folder = shutil.copytree(chat_target[0], tmp_path / "rewrites")
    (folder / "chat_template.jinja").write_text(CHATML.replace(
        "{{ m['content'] }}", "{% if loop.last %}{{ m['content'] }}{% else %}{{ m['content'][:3] }}{% endif %}"))
    path = write(tmp_path / "chat.jsonl", rows())
    cfg = H.load_config(config(folder, tmp_path, path, assistant_only_loss=True))
    with pytest.raises(ValueError) as e:
        H.token_streams(cfg, AutoTokenizer.from_pretrained(folder))
    assert str(e.value).startswith(f"{path}:") and "writes earlier turns differently" in str(e.value)
    assert "set assistant_only_loss: false" in str(e.value) and "{% generation %}" in str(e.value)
    # Without assistant_only_loss, the same template still trains on the whole text.
    assert len(H.token_streams(H.load_config(config(folder, tmp_path, path)), AutoTokenizer.from_pretrained(folder))[0])


def test_the_label_of_a_position_is_the_next_token():
    """Position s predicts the token at s + 1: it is learned when that token is in a reply."""
    in_reply = torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.uint8)
    assert H.learned_positions(in_reply).tolist() == [[False, True, True, False, True, False]]
    assert H.learned_positions(None) is None


def test_reply_masks_line_up_with_the_token_streams(chat_target, tmp_path):
    folder, tok = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    cfg = H.load_config(config(folder, tmp_path, path, assistant_only_loss=True))
    streams = H.token_streams(cfg, AutoTokenizer.from_pretrained(folder))
    masks = H.reply_masks(cfg, AutoTokenizer.from_pretrained(folder))
    for stream, mask, docs in zip(streams, masks, read_documents(path)):
        assert len(mask) == len(stream)
        # The masked tokens spell the replies (and the plain texts, which count whole), in order.
        want = "".join(f"{d[-1]['content']}<|im_end|>\n" if isinstance(d, list) else d for _, d in docs)
        assert tok.decode([int(t) for t, m in zip(stream, mask) if m]) == want
    # The token streams are the ones training without the mask reads.
    plain = H.token_streams(H.load_config(config(folder, tmp_path, path)), AutoTokenizer.from_pretrained(folder))
    assert [s.tolist() for s in plain] == [s.tolist() for s in streams]
    assert H.reply_masks(H.load_config(config(folder, tmp_path, path)), tok) is None


def test_assistant_only_loss_refusals(chat_target, tmp_path):
    folder, _ = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    with pytest.raises(ValueError, match="assistant_only_loss needs a data_file of conversations.*data_file"):
        H.load_config({"target": str(folder), "out": str(tmp_path), "assistant_only_loss": True})
    with pytest.raises(ValueError, match="assistant_only_loss must be true or false, got 'yes'"):
        H.load_config(config(folder, tmp_path, path, assistant_only_loss="yes"))
    users_only = write(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": f"question {i} " * 9}]}
                                                  for i in range(120)])
    cfg = H.load_config(config(folder, tmp_path, users_only, assistant_only_loss=True))
    with pytest.raises(ValueError, match="no assistant replies in its training split.*assistant_only_loss: false"):
        H.reply_masks(cfg, AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("kind, over", [("medusa", {"num_heads": 1}), ("mtp", {}), ("eagle", {}),
                                        ("eagle3", {"ttt_steps": 1, "draft_vocab": 64})])
def test_losses_count_only_the_learned_positions(chat_target, tmp_path, kind, over):
    """With learned positions M the loss is the mean of the one-position losses over M (they
    differ, so a mask that is ignored fails); with none learned it is 0 and moves nothing."""
    folder, tok = chat_target
    cfg = H.load_config(config(folder, tmp_path, tmp_path / "unused.jsonl", kind=kind, feature_noise=0.0, **over))
    target = load_for_reference(folder)
    torch.manual_seed(0)
    heads = H.build_heads(cfg, target, list(range(len(tok))))
    x = torch.randint(5, len(tok), (2, 12))
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    loss = lambda learned: H.batch_loss(cfg, heads, target, x, autocast, None, learned)[0]  # noqa: E731
    chosen = [(0, 2), (0, 5), (1, 3), (1, 7)]
    single = []
    for b, s in chosen:
        learned = torch.zeros_like(x, dtype=torch.bool)
        learned[b, s] = True
        single.append(loss(learned).item())
    learned = torch.zeros_like(x, dtype=torch.bool)
    learned[tuple(zip(*chosen))] = True
    assert loss(learned).item() == pytest.approx(sum(single) / len(single), rel=1e-5)
    assert max(single) - min(single) > 1e-3
    assert loss(torch.ones_like(x, dtype=torch.bool)).item() == pytest.approx(loss(None).item(), rel=1e-5)
    nothing = loss(torch.zeros_like(x, dtype=torch.bool))
    nothing.backward()
    assert nothing.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in heads.parameters())


def test_training_windows_carry_their_own_reply_mask(chat_target, tmp_path, monkeypatch):
    """Replies of digits, questions without any: a learned position is one whose next token is a
    digit or a reply's end, in every batch training draws; the final evaluation reads the held-out
    text's reply mask."""
    folder, tok = chat_target
    data = [{"messages": [{"role": "user", "content": f"Say the number for {w}"},
                          {"role": "assistant", "content": str(1000 + 37 * i)}]}
            for i, w in enumerate(["one", "two", "three", "four"] * 40)]
    path = write(tmp_path / "digits.jsonl", data)
    seen = []
    real = H.batch_loss

    def spy(cfg, heads, target, x, autocast, generator, learned=None, step_counts=None):
        seen.append((x.cpu(), learned.cpu()))  # training runs on CUDA where there is one
        return real(cfg, heads, target, x, autocast, generator, learned, step_counts)

    evaluated, agreement = [], H.heldout_agreement

    def evaluation_spy(cfg, heads, target, windows, learned, autocast):
        evaluated.append(learned)
        return agreement(cfg, heads, target, windows, learned, autocast)

    monkeypatch.setattr(H, "batch_loss", spy)
    monkeypatch.setattr(H, "heldout_agreement", evaluation_spy)
    metrics = H.train(config(folder, tmp_path, path, assistant_only_loss=True, max_steps=3))
    assert len(seen) == 3 and metrics["steps"] == 3
    # The final evaluation counts the held-out replies only, not the questions.
    assert len(evaluated) == 1 and evaluated[0] is not None and 0 < evaluated[0].float().mean() < 1
    in_reply = set(tok.convert_tokens_to_ids(list("0123456789") + ["<|im_end|>"])) | set(tok("\n")["input_ids"][1:])
    digits = set(tok.convert_tokens_to_ids(list("0123456789")))
    for x, learned in seen:
        following = x[:, 1:]
        assert learned[:, -1].logical_not().all()
        assert all(int(t) in in_reply for t in following[learned[:, :-1]])
        assert learned[:, :-1][torch.isin(following, torch.tensor(sorted(digits)))].all()
    config_written = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config_written["tree"]


def test_evaluations_and_token_counts_honour_the_learned_positions(chat_target):
    folder, tok = chat_target
    target = load_for_reference(folder)
    cfg = H.load_config({"target": str(folder), "out": "unused", "kind": "mtp"})
    torch.manual_seed(1)
    head = H.build_heads(cfg, target, list(range(len(tok))))
    windows = torch.randint(5, len(tok), (4, 16))
    run = lambda x: H.target_pass(target, x, lambda: torch.autocast("cpu", enabled=False))  # noqa: E731
    everything = evaluate_feature_head(head, run, windows, None, depths=2)
    assert max(everything["top5"]) > 0  # so that a mask that is ignored shows
    assert evaluate_feature_head(head, run, windows, None, 2, learned=torch.ones_like(windows, dtype=torch.bool)) \
        == everything
    assert evaluate_feature_head(head, run, windows, None, 2, learned=torch.zeros_like(windows, dtype=torch.bool)) \
        == {"top1": [0.0, 0.0], "top5": [0.0, 0.0]}
    medusa = H.build_heads(H.load_config({"target": str(folder), "out": "unused", "num_heads": 2}), target, [])
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    assert H.evaluate_heads(medusa, target, windows, 3, autocast, learned=torch.zeros_like(windows, dtype=torch.bool)) \
        == {"top1": [0.0, 0.0], "top5": [0.0, 0.0], "rank_accuracy": [[0.0] * 3] * 2}
    eagle3 = H.build_heads(H.load_config({"target": str(folder), "out": "unused", "kind": "eagle3"}), target,
                           list(range(len(tok))))
    run_aux = lambda x: aux_target_pass(target, x, eagle3.config.aux_layers, autocast)  # noqa: E731
    assert max(evaluate_eagle3(eagle3, run_aux, windows, 2)["top5"]) > 0
    assert evaluate_eagle3(eagle3, run_aux, windows, 2, learned=torch.zeros_like(windows, dtype=torch.bool)) \
        == {"top1": [0.0, 0.0], "top5": [0.0, 0.0]}
    # Token counts: with an identity "target" the picks are the window's own tokens.
    learned = torch.rand(windows.shape, generator=torch.Generator().manual_seed(2)) < 0.3
    counted = tokens_by_frequency(lambda x: (None, x), windows, len(tok), learned=learned)
    counts = torch.bincount(windows[learned], minlength=len(tok))
    assert counts[counted["order"]].tolist() == sorted(counts.tolist(), reverse=True)
    assert counted != tokens_by_frequency(lambda x: (None, x), windows, len(tok))


def test_the_vocab_command_counts_inside_replies(chat_target, tmp_path, capsys):
    """`draftsman vocab --data-file F --assistant-only`: the order heads trained with
    assistant_only_loss count, which differs from counting every position."""
    folder, tok = chat_target
    path = write(tmp_path / "chat.jsonl", rows())
    out = tmp_path / "order.json"
    args = ["vocab", "--target", str(folder), "--out", str(out), "--data-file", str(path), "--work-dir",
            str(tmp_path / "work"), "--tokens", "512", "--seq-len", "32", "--threads", "1"]
    assert cli.main([*args, "--assistant-only"]) == 0
    written = json.loads(out.read_text())
    assert "inside assistant replies" in written["counted_on"]
    cfg = H.load_config(config(folder, tmp_path, path, eval_tokens=512, assistant_only_loss=True))
    stream = H.token_streams(cfg, AutoTokenizer.from_pretrained(folder))[0]
    train_mask = H.reply_masks(cfg, AutoTokenizer.from_pretrained(folder))[0]
    reference, autocast = reference_where_the_cli_counts(folder)
    assert written["tokens_by_frequency"] == \
        H.target_token_frequencies(cfg, reference, stream, autocast, train_mask)["order"]
    assert written["tokens_by_frequency"] != H.target_token_frequencies(cfg, reference, stream, autocast)["order"]
    capsys.readouterr()
    assert cli.main([*args[:5], "--assistant-only"]) == 2
    assert "--assistant-only counts inside the replies of a --data-file" in capsys.readouterr().err
