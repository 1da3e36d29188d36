"""Drafting under no_repeat_ngram_size and bad words of several tokens (drafters/path_bans.py): a
drafter leaves out what the verifier will ban at each draft position, by that position's own
path. Drafts only: the output is tested to stay exact in test_row_bans.py (lone output for every
drafter) and test_engine_sampling.py (the T=1 chi-squares under no_repeat_ngram_size and bad
words, a draft model drafting); here, that the drafts keep out of the bans."""
import random
import shutil

import pytest
import torch

import draftsman
from draftsman.drafters.path_bans import PathBans
from draftsman.verifier.ngram_ban import BadWords, repeated_ngram_tokens
from draftsman.verifier.sampling import RowSampling, SamplingParams, processed_probs
from row_settings import NEW
from test_draft_vocab import write_order
from test_row_biases import COPIED_PROMPT, copying_drafts
from test_row_drafts import assert_all_accepted, self_drafting
from test_engine_sampling import ALPHA, fit_pvalue
from test_row_min_new_tokens import SAMPLED_PROMPT, close_draft, drafters  # noqa: F401 (a fixture)
from test_row_sampling import PROMPTS
from tiny_models import load_for_reference

VOCAB = 6  # few tokens: n-grams repeat often
SETTINGS = [SamplingParams(0.0, no_repeat_ngram_size=2), SamplingParams(0.0, no_repeat_ngram_size=2),
            SamplingParams(0.0, logit_bias={3: -100.0, 1: -2.0}),  # a milder bias bans nothing
            SamplingParams(0.0, bad_words_ids=[[4], [1, 2], [0, 3, 5]]),
            SamplingParams(0.0, no_repeat_ngram_size=3, bad_words_ids=[[2, 2]])]


def banned_alone(params: SamplingParams, sequence: list[int], everywhere: bool) -> set[int]:
    """What the verifier bans after `sequence` under `params` (the audit's plain forms); without
    `everywhere`, only what depends on the sequence (a -100 bias and one-token words left out)."""
    banned = repeated_ngram_tokens(sequence, params.no_repeat_ngram_size) if params.bans_repeated_ngrams else set()
    if params.bans_words:
        words = BadWords(params.bad_words_ids)
        banned |= words.banned_after(sequence) if everywhere else words.completing(sequence)
    if everywhere:
        banned |= {t for t, bias in params.logit_bias or () if bias <= -100}
    return banned


def test_each_rows_path_bans_are_what_the_verifier_bans_there():
    """Random contexts and paths over rounds; rows grow, one leaves, one joins: each row's bans
    after each path equal the plain per-sequence bans of its context and path."""
    rng = random.Random(5)
    settings = list(SETTINGS)
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))] for _ in settings]
    bans, checked = {False: PathBans(), True: PathBans(everywhere=True)}, 0
    for round_ in range(8):
        if round_ == 3:  # the first row leaves (the next one bans 2-grams too), a row with both bans joins
            settings, contexts = settings[1:] + [SETTINGS[4]], contexts[1:] + [[1, 2]]
            for each in bans.values():
                each.select_rows([1, 2, 3, 4])
        now = {everywhere: each.round(RowSampling(settings), contexts) for everywhere, each in bans.items()}
        for b, (params, context) in enumerate(zip(settings, contexts)):
            for _ in range(6):
                path = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
                for everywhere in (False, True):
                    want = banned_alone(params, context + path, everywhere)
                    assert now[everywhere].banned(b, path) == want, (round_, b, path)
                    checked += bool(want)
        for context in contexts:
            context += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 3))]
    assert checked > 100
    assert bans[True].round(SamplingParams(0.5), contexts) is None  # no row bans: nothing to do
    assert bans[False].round(SamplingParams(0.5, logit_bias={2: -100.0}), contexts) is None  # in the bias


def test_copied_continuations_end_before_a_banned_token():
    setting = SamplingParams(0.0, no_repeat_ngram_size=2, bad_words_ids=[[9], [7, 8]], logit_bias={0: -100.0})
    bans = PathBans(everywhere=True).round(setting, [[1, 2, 3, 7]])
    assert bans.cut(0, [4, 5, 6]) == [4, 5, 6]
    assert bans.cut(0, [4, 1, 2]) == [4, 1]  # (1, 2) is in the context
    assert bans.cut(0, [8, 1]) == []  # the word (7, 8) ends at the root
    assert bans.cut(0, [4, 9]) == [4]  # a one-token word
    assert bans.cut(0, [5, 0]) == [5]  # a -100 bias
    assert bans.cut(0, [4, 5, 4, 5]) == [4, 5, 4]  # (4, 5) is on the path


@pytest.mark.parametrize("name", ["ngram", "retrieval", "suffix", "recycling"])
def test_copying_drafters_end_each_rows_continuations_before_its_own_path_bans(name):
    """After "5 6" the prompt continues "7 8 5": a row banning 4-grams ends it after 7 ((5, 6, 7,
    8) is in the prompt), a row banning the word (7, 8) too; a row without bans copies it whole."""
    rows = RowSampling([SamplingParams(0.0, no_repeat_ngram_size=4), SamplingParams(0.0, bad_words_ids=[[7, 8]]),
                        SamplingParams(0.0)])
    trees = copying_drafts(name, rows)
    for tree, params in zip(trees, rows.rows):
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for j, token in enumerate(tokens):
            assert token not in banned_alone(params, COPIED_PROMPT + path_above(tokens, parents, j), everywhere=True)
    assert [7 in tree.tokens.tolist() for tree in trees] == [True] * 3
    assert [8 in tree.tokens.tolist() for tree in trees] == [False, False, True]


def path_above(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens of a node's ancestors below the root, root side first."""
    path, up = [], parents[node]
    while up >= 0:
        path.insert(0, tokens[up])
        up = parents[up]
    return path


def test_mask_sets_each_drafts_banned_logits():
    """(B, width) and (B, K, width) logits, token ids mapped to a draft vocabulary's columns or
    not, rows given: the banned columns are -inf, the rest unchanged; a draft with nothing left
    keeps its logits."""
    bans = PathBans().round(RowSampling([SamplingParams(0.0), SamplingParams(0.0, no_repeat_ngram_size=1)]),
                            [[0, 1], [2, 3]])
    logits = torch.zeros(2, VOCAB)
    out = bans.mask(logits, [[], [4]])
    assert torch.equal(out[0], logits[0]) and torch.isneginf(out[1]).tolist() == [0, 0, 1, 1, 1, 0]
    out = bans.mask(torch.zeros(1, 2, VOCAB), [[[5], [4, 0]]], rows=[1])  # row 1's drafts only
    assert torch.isneginf(out[0]).tolist() == [[0, 0, 1, 1, 0, 1], [1, 0, 1, 1, 1, 0]]
    bans.columns = {3: 0, 5: 1, 1: 2}  # a draft vocabulary of tokens 3, 5 and 1
    assert torch.isneginf(bans.mask(torch.zeros(2, 3), [[], [5]])).tolist() == [[0, 0, 0], [1, 1, 0]]
    full = bans.mask(torch.zeros(2, 2), [[], [5]])  # tokens 3 and 5 both banned in row 1
    assert torch.equal(full, torch.zeros(2, 2))


# Each row's own path bans, or none (plain decoding); NEW and 8 / 12 new tokens, so rows leave at
# different times. Each ban changes its row's greedy output (conftest's plain): row 0's output
# starts with the word, row 2's repeats a token, row 3's a 3-gram.
def row_bans(plain: list[list[int]]) -> dict:
    return {"no_repeat_ngram_size": [None, None, 1, 3], "bad_words_ids": [[plain[0][:2]], None, [[9, 7]], None]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_row_drafts_without_its_own_path_bans(tiny_models, plain, temperature):
    """The target drafting for itself, each row under its own n-gram ban and bad words: every row
    accepts (almost) every draft. A draft of a banned token would be rejected."""
    target = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": self_drafting(target)})
    limits = [NEW, 8, NEW, 12]
    out = decoder.generate(input_ids=PROMPTS, max_new_tokens=limits, temperature=temperature, seed=3, ignore_eos=True,
                           **row_bans(plain))
    assert [len(t) for t in out.token_ids] == limits
    assert_all_accepted(out.stats)
    if temperature == 0.0:  # each ban mattered; the row without one is plain decoding
        assert [out.token_ids[r] == plain[r][:limits[r]] for r in range(4)] == [False, True, False, False]


@pytest.fixture(scope="module")
def reordered_draft(close_draft, tmp_path_factory):  # noqa: F811
    """close_draft with a token order that is not the ids' (draft_vocab's logit index != token id)."""
    folder = tmp_path_factory.mktemp("reordered-draft")
    shutil.copytree(close_draft, folder, dirs_exist_ok=True)
    write_order(folder, list(range(319, -1, -1)))
    return folder


@pytest.mark.parametrize("name", ["ngram", "suffix", "recycling", "draft_model", "draft_model_tree",
                                  "draft_model_vocab", "eagle3", "mtp", "medusa"])
def test_no_draft_is_banned_by_its_own_path(tiny_models, fresh_heads, close_draft, reordered_draft,  # noqa: F811
                                            name):
    """Every node every drafter proposes, under each row's own ban: its token is not one the
    verifier bans after the row's context and the node's ancestors."""
    spec = {"name": "draft_model", "path": str(reordered_draft), "k": 4, "draft_vocab": 300} \
        if name == "draft_model_vocab" else drafters(tiny_models, close_draft, fresh_heads)[name]
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}, "drafter": spec})
    settings = {"no_repeat_ngram_size": [1, None, 2, 4], "bad_words_ids": [None, [[13, 12]], None, None]}
    rows = [SamplingParams(0.0, no_repeat_ngram_size=n, bad_words_ids=w)
            for n, w in zip(*settings.values())]
    seen, propose = [], decoder.engine.drafter.propose

    def recording(contexts):
        trees = propose(contexts)
        seen.extend((list(context), tree) for context, tree in zip(contexts, trees))  # rows grow in place
        return trees

    decoder.engine.drafter.propose = recording
    prompts = [p * 3 for p in PROMPTS]  # repeats for `ngram` to copy
    decoder.generate(input_ids=prompts, max_new_tokens=24, temperature=0.0, ignore_eos=True, **settings)
    row_of = {tuple(p): params for p, params in zip(prompts, rows)}
    nodes = 0
    for context, tree in seen:
        params = next(row_of[p] for p in row_of if tuple(context[:len(p)]) == p)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for j, token in enumerate(tokens):
            path = path_above(tokens, parents, j)
            assert token not in banned_alone(params, context + path, everywhere=True), (name, context, path, token)
            nodes += params.bans_repeated_ngrams or params.bans_words
    assert nodes >= 20, nodes  # banned rows drafted


def test_sampled_drafts_under_a_path_ban_follow_the_target(tiny_models, close_draft):  # noqa: F811
    """T=1: two-token bad words that end the prompt with the target's 20 likeliest next tokens,
    so the drafts' ban takes most of the draft model's mass at depth 1. The first tokens follow
    the banned target distribution: each draft's q must be the masked distribution it was drawn
    from (the unmasked one fails this)."""
    target = tiny_models["llama"][0]
    with torch.no_grad():
        logits = load_for_reference(target)(input_ids=torch.tensor([SAMPLED_PROMPT])).logits[0, -1].double()
    top = logits.topk(20).indices.tolist()
    banned = logits.clone()
    banned[top] = -torch.inf
    decoder = draftsman.load({"target": {"path": str(target)},
                              "drafter": {"name": "draft_model", "path": str(close_draft), "k": 3}})
    out = decoder.generate(input_ids=[SAMPLED_PROMPT] * 3000, max_new_tokens=2, temperature=1.0, seed=7,
                           bad_words_ids=[[SAMPLED_PROMPT[-1], t] for t in top])
    assert out.stats.tau > 1.01  # drafts were accepted, and rejected
    first = torch.tensor([t[0] for t in out.token_ids])
    assert fit_pvalue(first, processed_probs(banned, SamplingParams(1.0))) > ALPHA
