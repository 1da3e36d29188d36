"""no_repeat_ngram_size and bad_words_ids: the banned tokens are Hugging Face's
(NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor) for one sequence and for every node of
a verification block, and greedy output through any drafter equals the target's own
generate(no_repeat_ngram_size=n) / generate(bad_words_ids=...). Sampling under the ban:
tests/test_engine_sampling.py (chi-square on the whole engine)."""
import json
import random

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor

import draftsman
from draftsman import cli
from draftsman.verifier.ngram_ban import BadWords, RepeatedNgrams, repeated_ngram_tokens
from draftsman.verifier.tree import TreeBlock

from serving import call
from tiny_models import load_for_reference, perturbed_copy

VOCAB = 6  # few tokens: n-grams repeat often


def hf_banned(sequence: list[int], n: int, vocab: int = VOCAB) -> set[int]:
    scores = NoRepeatNGramLogitsProcessor(n)(torch.tensor([sequence]), torch.zeros(1, vocab))
    return set(torch.isinf(scores[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_one_sequence_bans_what_hugging_face_bans(n):
    rng = random.Random(n)
    banned_any = 0
    for length in range(1, 60):
        sequence = [rng.randrange(3 if n > 2 else VOCAB) for _ in range(length)]  # long n-grams repeat too
        assert repeated_ngram_tokens(sequence, n) == hf_banned(sequence, n), sequence
        banned_any += bool(hf_banned(sequence, n))
    assert banned_any > 20  # the check has something to compare


def random_block(rng: random.Random, rows: int, nodes: int, pool: list[int] | None = None) -> TreeBlock:
    """Roots and random trees (each node's parent earlier), ragged: padding after a row's nodes;
    tokens below VOCAB, or drawn from `pool`."""
    T = nodes + 1
    tokens = torch.zeros(rows, T, dtype=torch.long)
    parents = torch.full((rows, T), -1, dtype=torch.long)
    valid = torch.zeros(rows, T, dtype=torch.bool)
    for b in range(rows):
        size = rng.randrange(nodes + 1)
        valid[b, : size + 1] = True
        for j in range(T):
            tokens[b, j] = rng.randrange(VOCAB) if pool is None else rng.choice(pool)
            if 1 <= j <= size:
                parents[b, j] = rng.randrange(j)
    return TreeBlock(tokens, parents, valid)


def path_of(block: TreeBlock, b: int, j: int) -> list[int]:
    path = []
    while j > 0:
        path.append(int(block.tokens[b, j]))
        j = int(block.parents[b, j])
    return path[::-1]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_node_bans_what_its_own_sequence_bans(n):
    """A node's sequence: its row's committed tokens (the root last) and its path; rounds extend
    the committed tokens, and each row keeps its own index (rows leave, so original ids are used)."""
    rng = random.Random(10 + n)
    ban = RepeatedNgrams(n)
    contexts = {row: [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))] for row in (0, 3, 7)}
    checked = nonempty = 0
    for _ in range(10):  # rounds
        rows = sorted(contexts)
        block = random_block(rng, len(rows), nodes=6)
        block.tokens[:, 0] = torch.tensor([contexts[r][-1] for r in rows])  # each root is its row's last token
        logits = torch.zeros(len(rows), block.tokens.shape[1], VOCAB)
        ban.ban_(logits, block, rows, [contexts[r] for r in rows])
        for b, row in enumerate(rows):
            for j in range(block.tokens.shape[1]):
                got = set(torch.isinf(logits[b, j]).nonzero().flatten().tolist())
                if not block.valid[b, j]:
                    assert got == set()
                    continue
                assert got == hf_banned(contexts[row] + path_of(block, b, j), n), (row, j)
                checked += 1
                nonempty += bool(got)
        for row in rows:  # commit a few tokens
            contexts[row] += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]
        if len(contexts) > 1 and rng.random() < 0.3:
            contexts.pop(rng.choice(sorted(contexts)))  # a row leaves
    assert checked > 50 and nonempty > 20


@pytest.fixture(scope="module")
def close_draft(tiny_models, tmp_path_factory):
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("close"), noise=0.05)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8], [11, 12, 13, 14]]


def with_drafter(tiny_models, close_draft, drafter: str):
    cfg = {"none": {"name": "none"}, "ngram": {"name": "ngram", "k": 4, "branches": 2, "min_ngram": 1},
           "draft_model_tree": {"name": "draft_model", "path": str(close_draft), "k": 4, "top_k": 3,
                                "total_tokens": 8}}[drafter]
    return draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": cfg})


def hf_greedy(target, **generate_args) -> list[list[int]]:
    """The target's own generate, 30 new tokens, one prompt at a time."""
    model = load_for_reference(target)
    want = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long), **generate_args)
        want.append(gen[0, len(p):].tolist())
    return want


@pytest.mark.parametrize("n", [1, 2, 3])  # (with n = 1 the ban bites in every row of these prompts)
@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model_tree"])
def test_greedy_output_equals_the_targets_own(tiny_models, close_draft, drafter, n):
    decoder = with_drafter(tiny_models, close_draft, drafter)
    want = hf_greedy(tiny_models["llama"][0], no_repeat_ngram_size=n)
    banned = decoder.generate(input_ids=PROMPTS, max_new_tokens=30, no_repeat_ngram_size=n)
    assert banned.token_ids == want  # batch 3
    # The first row leaves after 5 tokens and the others move up the batch: each keeps its own n-grams.
    early = decoder.generate(input_ids=PROMPTS, max_new_tokens=[5, 30, 30], no_repeat_ngram_size=n)
    assert early.token_ids == [want[0][:5], *want[1:]]
    assert decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=30, no_repeat_ngram_size=n).token_ids == want[:1]
    plain = decoder.generate(input_ids=PROMPTS, max_new_tokens=30).token_ids
    assert plain != want  # the ban changed what greedy decoding emits: the check has power
    if drafter == "draft_model_tree":  # (ngram's drafts repeat n-grams: under the ban, seldom accepted)
        assert banned.stats.tau > 1.0


def test_bad_sizes_are_named(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="no_repeat_ngram_size must be a whole number >= 0"):
            decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=4, no_repeat_ngram_size=bad)


EOS = 5
WORDS = [[3], [EOS], [1, 2], [2, 0, 4], [4, 4]]  # [EOS] alone is ignored, as Hugging Face ignores it


def hf_bad_words(sequence: list[int], words=WORDS) -> set[int]:
    scores = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)(torch.tensor([sequence]), torch.zeros(1, VOCAB))
    return set(torch.isinf(scores[0]).nonzero().flatten().tolist())


def test_bad_words_are_banned_where_hugging_face_bans_them():
    rng = random.Random(5)
    ban = BadWords(WORDS, eos_token_ids={EOS})
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    checked = multi = 0
    for _ in range(10):
        block = random_block(rng, len(contexts), nodes=6)
        block.tokens[:, 0] = torch.tensor([c[-1] for c in contexts])
        logits = torch.zeros(len(contexts), block.tokens.shape[1], VOCAB)
        ban.ban_(logits, block, list(range(len(contexts))), contexts)
        for b, context in enumerate(contexts):
            for j in range(block.tokens.shape[1]):
                if not block.valid[b, j]:
                    continue
                sequence = context + path_of(block, b, j)
                want = hf_bad_words(sequence)
                assert set(torch.isinf(logits[b, j]).nonzero().flatten().tolist()) == want, sequence
                assert ban.banned_after(sequence) == want
                checked += 1
                multi += len(want) > 1
        for context in contexts:
            context += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3))]
    assert checked > 50 and multi > 10  # words of several tokens matched often enough to count
    # A word's prefix reaching back into the committed tokens from a root: [2, 0] then 4.
    roots = TreeBlock.column(torch.tensor([0]))
    logits = torch.zeros(1, 1, VOCAB)
    ban.ban_(logits, roots, [0], [[1, 2, 0]])
    assert set(torch.isinf(logits[0, 0]).nonzero().flatten().tolist()) == hf_bad_words([1, 2, 0]) == {3, 4}


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model_tree"])
def test_greedy_output_without_bad_words_equals_the_targets_own(tiny_models, close_draft, drafter):
    decoder = with_drafter(tiny_models, close_draft, drafter)
    plain = decoder.generate(input_ids=PROMPTS, max_new_tokens=30).token_ids
    # Words that bite: the first row's first token everywhere, and each row's 3rd-4th tokens as a pair.
    words = [[plain[0][0]]] + [row[2:4] for row in plain if len(row) >= 4]
    want = hf_greedy(tiny_models["llama"][0], bad_words_ids=words)
    got = decoder.generate(input_ids=PROMPTS, max_new_tokens=30, bad_words_ids=words)
    assert got.token_ids == want and want != plain
    assert decoder.generate(input_ids=PROMPTS[1:2], max_new_tokens=30, bad_words_ids=words).token_ids == want[1:2]


@pytest.mark.parametrize("words, message", [([[]], "bad_words_ids must be a list of token-id lists"),
                                            ("x", "bad_words_ids must be a list of token-id lists"),
                                            ([[1, -2]], "bad_words_ids must be a list of token-id lists"),
                                            ([[1, 10**6]], r"bad_words_ids has token ids \[1000000\] outside")])
def test_bad_words_that_are_not_token_ids_are_named(tiny_models, words, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=message):
        decoder.generate(input_ids=PROMPTS[:1], max_new_tokens=4, bad_words_ids=words)


def test_the_cli_and_the_server_take_both(served, tmp_path, capsys):
    decoder, base = served
    prompt = [5, 6, 7, 8, 5, 6]
    plain = decoder.generate(input_ids=[prompt], max_new_tokens=12).token_ids[0]
    settings = {"no_repeat_ngram_size": 2, "bad_words_ids": [[plain[0]], plain[1:3]]}
    want = decoder.generate(input_ids=[prompt], max_new_tokens=12, **settings)
    assert want.token_ids[0] != plain
    status, got = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": 12, **settings})
    assert status == 200 and got["choices"][0]["text"] == want.texts[0]

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"target": decoder.config["target"], "drafter": decoder.config["drafter"]}))
    words = [arg for w in settings["bad_words_ids"] for arg in ("--bad-word", ",".join(map(str, w)))]
    assert cli.main(["generate", "--config", str(config), "--input-ids", ",".join(map(str, prompt)),
                     "--max-new-tokens", "12", "--no-repeat-ngram-size", "2", *words, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit for a bad value
        cli.main(["generate", "--config", str(config), "--input-ids", "1", "--bad-word", "1,x"])
    assert exit_.value.code == 2
    assert "'1,x': expected token ids separated by commas" in capsys.readouterr().err
