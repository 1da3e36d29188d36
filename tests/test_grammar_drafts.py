"""Drafting within the grammar (verifier/grammar.py's DraftGrammar, drafters/path_bans.py): under
structured output every drafter that takes path bans drafts only tokens the row's grammar allows
after the row's output and the drafts above, so fewer drafts are rejected; the output stays plain
decoding under the grammar (tests/test_structured_output.py checks that for every drafter)."""
import dataclasses
import json
import random
import shutil

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import draftsman
from draftsman.verifier.structured import StructuredOutput
from draftsman.verifier.token_masks import TokenMasks
from test_row_min_new_tokens import close_draft, drafters  # noqa: F401 (a fixture)
from test_structured_output import GRAMMARS, NEW, PROMPTS, allowed_after, reference_outputs
from tiny_models import target_device

HELD = ["ngram", "suffix", "recycling", "draft_model", "draft_model_tree", "draft_model_vocab", "eagle3", "mtp", "medusa", "cascade",
        "draft_model_adaptive"]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def vocab_draft(close_draft, tmp_path_factory):  # noqa: F811
    """close_draft with a draft vocabulary order: half the tokens, shuffled (draft column i is
    not token i, and some tokens a grammar allows are not in it)."""
    folder = tmp_path_factory.mktemp("vocab-draft") / "draft"
    shutil.copytree(close_draft, folder)
    order = list(range(AutoConfig.from_pretrained(folder).vocab_size))
    random.Random(0).shuffle(order)
    (folder / "tokens_by_frequency.json").write_text(json.dumps({"tokens_by_frequency": order}))
    return folder, order[:len(order) // 2]


def held_drafters(tiny_models, close_draft, fresh_heads, vocab_draft):  # noqa: F811
    folder, tokens = vocab_draft
    return {**drafters(tiny_models, close_draft, fresh_heads),
            "draft_model_vocab": {"name": "draft_model", "path": str(folder), "k": 4, "draft_vocab": len(tokens)}}


def grammar_checks(seen: dict, prompts: list[list[int]], specs: list, tokenizer, vocab: int, ends: set[int],
                   draftable: torch.Tensor | None = None):
    """(draft nodes the grammar holds, those among them it forbids, sampled nodes whose q gives a
    forbidden token mass) over the recorded trees; each node checked with a fresh matcher fed the
    row's output and the node's path above it. draftable: (vocab,) bool, the tokens a draft
    vocabulary holds; a node where it holds nothing the grammar allows is not counted (the
    drafter keeps its logits there: nothing it drafts can be accepted)."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(ends))
    held = forbidden = q_leaks = 0
    for context, (tokens, parents, probs) in seen.items():
        b = next(i for i, p in enumerate(prompts) if list(context[:len(p)]) == p)
        output = list(context[len(prompts[b]):])
        grammar = StructuredOutput.parse(specs[b]).grammar()
        paths: list[list[int]] = []
        for j, (token, parent) in enumerate(zip(tokens, parents)):
            above = [] if parent < 0 else paths[parent]
            paths.append(above + [token])
            if any(t in ends for t in above):  # below an end: never emitted
                continue
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            if matcher.validate_tokens(output + above) < len(output + above):  # a forbidden draft above
                continue
            matcher.consume_tokens(output + above)
            allowed = allowed_after(matcher, vocab)
            if allowed[sorted(ends)].any():
                allowed[sorted(ends)] = True
            if draftable is not None and not (allowed & draftable).any():
                continue
            held += 1
            forbidden += not allowed[token]
            if probs is not None and probs[j] is not None:
                q_leaks += bool(probs[j][~allowed].sum() > 0)
    return held, forbidden, q_leaks


def record_with_q(decoder) -> dict:
    """record_trees, with each node's q (None for a deterministic node)."""
    seen, propose = {}, decoder.engine.drafter.propose

    def recording(contexts):
        trees = propose(contexts)
        for context, tree in zip(contexts, trees):
            probs = None
            if tree.draft_probs is not None:
                probs = [q if kind else None
                         for q, kind in zip(tree.draft_probs[:, :vocab(decoder)], tree.kinds.tolist())]
            seen[tuple(context)] = (tree.tokens.tolist(), tree.parents.tolist(), probs)
        return trees

    decoder.engine.drafter.propose = recording
    return seen


def vocab(decoder) -> int:
    return decoder.engine.vocab_size


@pytest.mark.parametrize("name", HELD)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_stay_within_each_rows_grammar(name, temperature, tiny_models, close_draft, fresh_heads,  # noqa: F811
                                              vocab_draft, tokenizer):
    """Four rows, each with a grammar of its own kind: no draft is a token the row's grammar
    forbids after its path, and a sampled draft's q gives forbidden tokens no mass. With drafts
    left free (the engine's draft_within_grammar False) the same run drafts forbidden tokens, so
    the check can fail; the outputs are equal either way (greedy: plain decoding's)."""
    folder = tiny_models["llama"][0]
    drafter = held_drafters(tiny_models, close_draft, fresh_heads, vocab_draft)[name]
    decoder = draftsman.load({"target": {"path": str(folder), "device": target_device(drafter)}, "drafter": drafter})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    specs = list(GRAMMARS.values())
    ends = decoder.engine.eos_token_ids
    draftable = None
    if name == "draft_model_vocab":
        draftable = torch.zeros(vocab(decoder), dtype=torch.bool)
        draftable[vocab_draft[1]] = True
    results = {}
    for within in (True, False):
        decoder.engine.draft_within_grammar = within
        decoder.drafter.forget_outputs()  # each run drafts from what it learns itself (recycling)
        seen = record_with_q(decoder)
        out = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=specs, temperature=temperature,
                               seed=3)
        del decoder.engine.drafter.propose  # the recording wrapper
        results[within] = grammar_checks(seen, ids, specs, tokenizer, vocab(decoder), ends, draftable), out
    (held, forbidden, q_leaks), out = results[True]
    (free_held, free_forbidden, _), free_out = results[False]
    assert held >= (3 if name in ("ngram", "suffix", "recycling") else 8), held  # enough drafts to check
    assert forbidden == 0 and q_leaks == 0, (forbidden, q_leaks, held)
    assert free_forbidden > 0, (free_forbidden, free_held)  # drafted free, the same drafter breaks the grammar
    if temperature == 0.0:
        assert out.token_ids == free_out.token_ids == reference_outputs(folder, tokenizer, ids, specs, ends)
    assert out.stats.tau >= free_out.stats.tau or temperature > 0, (out.stats.tau, free_out.stats.tau)


def test_a_copied_continuation_ends_before_what_the_grammar_forbids(tiny_models, tokenizer):
    """`ngram` under a regex the prompt's text breaks: each copied continuation is cut before the
    first token the grammar forbids, so every draft it proposes is accepted or rejected by the
    target's choice, never by the grammar; with drafts left free it proposes forbidden ones."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 4, "min_ngram": 1}})
    text = "ab ab ab (ab) ab ab (ab) ab ab"
    ids = [tokenizer(text)["input_ids"]]
    spec = {"regex": "[ab ]{1,40}"}  # the prompt's brackets are forbidden
    counts = {}
    for within in (True, False):
        decoder.engine.draft_within_grammar = within
        seen = record_with_q(decoder)
        decoder.generate(input_ids=ids, max_new_tokens=16, structured_output=spec)
        del decoder.engine.drafter.propose
        counts[within] = grammar_checks(seen, ids, [spec], tokenizer, vocab(decoder), decoder.engine.eos_token_ids)
    assert counts[True][0] >= 4 and counts[True][1] == 0, counts
    assert counts[False][1] > 0, counts


def test_a_draft_vocabulary_without_an_allowed_token_keeps_its_logits():
    """PathBanRound.mask under a grammar: columns of a draft vocabulary that the grammar forbids
    get -inf; a position whose draft vocabulary holds nothing the grammar allows keeps its logits
    (nothing to draft is better than -inf everywhere); token ids map to columns."""
    from draftsman.drafters.path_bans import PathBanRound, _RowBan

    class Grammar:  # allows token 5 on row 0, token 1 on row 1 (not in the draft vocabulary)
        vocab_size = 8
        def masks(self, asks):
            allowed = torch.zeros(len(asks), self.vocab_size, dtype=torch.bool)
            for i, (_, row, _) in enumerate(asks):
                allowed[i, 5 if row == 0 else 1] = True
            return [key for key, _, _ in asks], TokenMasks.packed(allowed)

    vocab_map = torch.tensor([2, 5, 7])  # draft column -> token id
    bans = PathBanRound([_RowBan(None, None, frozenset(), []) for _ in range(2)], Grammar())
    bans.columns, bans.vocab_map = {2: 0, 5: 1, 7: 2}, vocab_map
    logits = torch.zeros(2, 3)
    out = bans.mask(logits, [[], [3]])
    assert out[0].tolist() == [-torch.inf, 0.0, -torch.inf]
    assert out[1].tolist() == [0.0, 0.0, 0.0]
    assert logits.eq(0).all()  # the caller's logits are left as they were


def test_draft_grammar_allows_what_a_fresh_matcher_allows(tokenizer):
    """DraftGrammar against fresh matchers, over random paths and continuations of rows with their
    own grammars (or none), end tokens and one grammar that waits for a marker: allowed() holds a
    path exactly where a fresh matcher fed the row's output and the path holds it (not before the
    marker, not below an end, not after a forbidden token) and allows what that matcher allows,
    the row's end tokens where it may end; fits() cuts a continuation before its first token
    allowed nowhere, and after its first end token; the matchers are left at the committed output."""
    from draftsman.verifier.grammar import GrammarCompiler, RowGrammars
    from test_structured_output import grammar_part

    rng = random.Random(1)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    a, b_, c, x = (tokenizer.convert_tokens_to_ids(t) for t in "abcx")
    pool = [a, b_, c, x, eos]
    regex = StructuredOutput.parse({"regex": "[ab]{1,5}c?"})
    specs = [regex, None, StructuredOutput.parse({"regex": "(ab|c)+"}),
             dataclasses.replace(StructuredOutput.parse({"regex": "ab[ab]{0,3}c?"}), after=(c, x))]  # forces "ab"
    ends = [frozenset({eos}), frozenset({eos}), frozenset({eos, x}), frozenset({eos})]
    outputs = [[a], [x, x], [a, b_], [c]]  # the last waits for its marker (c x): c may be its first half
    grammars = RowGrammars(GrammarCompiler(tokenizer, vocab, {eos}))
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[eos])

    def expected(row: int, path: list[int]) -> torch.Tensor | None:
        spec = specs[row]
        held = None if spec is None else grammar_part(outputs[row] + path, spec)
        if held is None or any(t in ends[row] for t in path):
            return None
        fresh = llguidance.LLMatcher(lltok, spec.grammar(), log_level=0)
        if fresh.validate_tokens(held) < len(held):
            return None
        fresh.consume_tokens(held)
        allowed = allowed_after(fresh, vocab)
        if allowed[eos]:
            allowed[list(ends[row])] = True
        return allowed

    checked = {"held": 0, "free": 0, "cut": 0, "forced": 0}
    for round_ in range(6):
        draft = grammars.drafts([0, 1, 2, 3], outputs, specs, ends)
        asks = [((row, i), row, [rng.choice(pool) for _ in range(rng.randrange(4))])
                for row in range(4) for i in range(12)]
        keys, allowed = draft.allowed(asks, vocab)
        for key, row, path in asks:
            want = expected(row, path)
            if want is None:
                assert key not in keys, (row, path)
                checked["free"] += 1
            else:
                assert torch.equal(allowed[keys.index(key)], want), (row, path)
                checked["held"] += 1
        for row in range(4):
            held = None if specs[row] is None else grammar_part(outputs[row], specs[row])
            fresh = llguidance.LLMatcher(lltok, specs[row].grammar(), log_level=0) if held is not None else None
            assert draft.forced(row) == (fresh.compute_ff_tokens() if fresh and fresh.consume_tokens(held) else [])
            checked["forced"] += bool(draft.forced(row))
            for _ in range(6):
                continuation = [rng.choice(pool) for _ in range(6)]
                cut = next((j for j in range(len(continuation)) if (want := expected(row, continuation[:j])) is not None
                            and not want[continuation[j]]), len(continuation))
                if specs[row] is not None:  # with a grammar, nothing after an end is drafted
                    cut = min(cut, next((j + 1 for j, t in enumerate(continuation) if t in ends[row]), cut))
                assert draft.fits(row, continuation) == cut, (row, continuation)
                checked["cut"] += cut < len(continuation)
        for row, spec in enumerate(specs):  # commit an allowed token, as the engine does
            if spec is not None and grammar_part(outputs[row], spec) is None:  # the marker, in round 3
                outputs[row] += [c, x] if round_ == 3 else [rng.choice([a, b_, c])]
            elif spec is not None:
                want = expected(row, [])
                choices = [t for t in pool if t not in ends[row] and (want is None or want[t])]
                outputs[row] += [rng.choice(choices)] if choices else []
    assert checked["held"] > 40 and checked["free"] > 40 and checked["cut"] > 20 and checked["forced"] > 0, checked
    assert grammar_part(outputs[3], specs[3]) is not None  # the marked row's grammar began


@pytest.mark.parametrize("drafter", [{"name": "ngram", "k": 4, "min_ngram": 1},
                                     {"name": "suffix", "min_match": 1, "max_cached_requests": 0},
                                     {"name": "recycling"}],
                         ids=["ngram", "suffix", "recycling"])
def test_copying_drafters_draft_what_the_grammar_forces(tiny_models, tokenizer, monkeypatch, drafter):
    """Under a JSON schema with fixed keys, `ngram`, `suffix` and `recycling` draft the tokens the grammar forces
    next (llguidance's fast-forward tokens) as a branch of their tree: each round's tree holds
    them, the output is unchanged, and more drafts are accepted than without them."""
    from draftsman.verifier.grammar import DraftGrammar

    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    spec = GRAMMARS["json"]
    ends = sorted(decoder.engine.eos_token_ids)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab(decoder), eos_token=ends)
    grammar = StructuredOutput.parse(spec).grammar()
    seen = record_with_q(decoder)
    out = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=spec)
    del decoder.engine.drafter.propose
    rounds_forced = 0
    for context, (tokens, parents, _) in seen.items():
        b = next(i for i, p in enumerate(ids) if list(context[:len(p)]) == p)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        matcher.consume_tokens(list(context[len(ids[b]):]))
        forced = matcher.compute_ff_tokens()[:4]
        if forced:
            rounds_forced += 1
            chain = [j for j, parent in enumerate(parents) if parent == -1 and tokens[j] == forced[0]]
            assert chain, (context, forced, tokens)
            for token in forced[1:]:  # the branch goes on with the forced tokens
                chain = [j for j, parent in enumerate(parents) if parent == chain[0] and tokens[j] == token]
                assert chain, (context, forced, tokens)
    assert rounds_forced >= 4, rounds_forced
    monkeypatch.setattr(DraftGrammar, "forced", lambda self, row: [])
    decoder.drafter.forget_outputs()  # recycling: from what this run learns alone, as the first
    without = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=spec)
    assert out.token_ids == without.token_ids
    assert out.stats.tau > without.stats.tau, (out.stats.tau, without.stats.tau)
