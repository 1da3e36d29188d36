"""Structured output (verifier/structured.py, verifier/grammar.py): the output held to a grammar
is exactly plain decoding under the grammar's mask, for every drafter, tree shape and batch.

The reference here is independent of the engine's tree walk: a Hugging Face logits processor with
its own llguidance matcher, fed one token at a time, and fresh matchers per tree node."""
import dataclasses
import json
import random
import re

import llguidance
import llguidance.hf
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
from transformers import LogitsProcessor, LogitsProcessorList

import draftsman
from draftsman import JoiningPrompt
from draftsman.verifier.grammar import GrammarCompiler, RowGrammars
from draftsman.verifier.sampling import SamplingParams, processed_probs
from draftsman.verifier.structured import StructuredOutput
from test_engine_sampling import ALPHA, fit_pvalue
from test_ngram_ban import random_block
from test_row_min_new_tokens import close_draft, drafters  # noqa: F401 (a fixture)
from tiny_models import load_for_reference, target_device

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                                           "n": {"type": "integer"}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
GRAMMARS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": r"(def|class) [a-z_]{1,12}\((self)?\):"},
    "choice": {"choice": ["return None", "return self", "pass", "raise"]},
    "lark": {"grammar": 'start: "x = " NUM (" + " NUM)*\nNUM: /[0-9]{1,3}/'},
}
PROMPTS = ["def test(self):\n    ", "class A:\n    def", "import os\n", "x"]
NEW = 24


def allowed_after(matcher, vocab: int) -> torch.Tensor:
    """(vocab,) bool: what the matcher allows next."""
    bitmask = allocate_token_bitmask(1, matcher_vocab(vocab))
    fill_next_token_bitmask(matcher, bitmask, 0)
    return ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab]


def matcher_vocab(vocab: int) -> int:
    return (vocab + 31) // 32 * 32


class GrammarReference(LogitsProcessor):
    """Plain decoding under a grammar, as Hugging Face runs a logits processor: one matcher fed
    each new token; EOS where the grammar may end."""

    def __init__(self, tokenizer, spec: StructuredOutput, prompt_length: int, vocab: int, eos: list[int]):
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.matcher = llguidance.LLMatcher(lltok, spec.grammar())
        self.spec, self.start, self.seen, self.vocab = spec, prompt_length, 0, vocab

    def __call__(self, input_ids, scores):
        held = grammar_part(input_ids[0, self.start:].tolist(), self.spec)
        if held is None:  # waiting for the marker: free
            return scores
        assert self.matcher.consume_tokens(held[self.seen:])
        self.seen = len(held)
        return scores.masked_fill(~allowed_after(self.matcher, self.vocab)[None], float("-inf"))


def reference_outputs(folder, tokenizer, prompts: list[list[int]], specs: list, eos: set[int], new: int = NEW):
    model = load_for_reference(folder)
    vocab = model.get_output_embeddings().weight.shape[0]
    out = []
    for prompt, spec in zip(prompts, specs):
        processors = LogitsProcessorList([GrammarReference(tokenizer, StructuredOutput.parse(spec), len(prompt),
                                                           vocab, sorted(eos))] if spec else [])
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, logits_processor=processors,
                             eos_token_id=sorted(eos), attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        out.append(gen[0, len(prompt):].tolist())
    return out


def holds(spec: dict, text: str) -> bool:
    """A finished output is what its grammar describes."""
    kind = next(k for k in spec if k in ("json", "regex", "choice", "grammar"))
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"ok", "tag", "n"} and isinstance(value["ok"], bool) and value["tag"] in ("red", "green")
    if kind == "regex":
        return re.fullmatch(spec["regex"], text) is not None
    if kind == "choice":
        return text in spec["choice"]
    return re.fullmatch(r"x = [0-9]{1,3}( \+ [0-9]{1,3})*", text) is not None


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_models["llama"][0])


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "draft_model_tree", "medusa", "eagle3", "mtp",
                                  "cascade"])
def test_greedy_output_is_plain_decoding_under_the_grammar(name, tiny_models, close_draft,  # noqa: F811
                                                           fresh_heads, tokenizer):
    """Every drafter, batch 1 and 4, four kinds of grammar: the output equals Hugging Face's greedy
    generate with the grammar's mask as a logits processor, and a finished row is what its
    grammar describes."""
    folder = tiny_models["llama"][0]
    drafter = drafters(tiny_models, close_draft, fresh_heads)[name]
    decoder = draftsman.load({"target": {"path": str(folder), "device": target_device(drafter)}, "drafter": drafter})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    specs = list(GRAMMARS.values())
    expected = reference_outputs(folder, tokenizer, ids, specs, decoder.engine.eos_token_ids)
    batched = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=specs)
    assert batched.token_ids == expected, name
    finished = 0
    for spec, text, reason in zip(specs, batched.texts, batched.stats.finish_reasons):
        if reason == "eos":
            assert holds(spec, text), (spec, text)
            finished += 1
    assert finished >= 3  # the grammars end rows, and the check above has outputs to read
    for prompt, spec, tokens in zip(ids, specs, expected):
        assert decoder.generate(input_ids=[prompt], max_new_tokens=NEW, structured_output=spec).token_ids[0] == tokens


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model_tree", "eagle3"])
def test_a_grammar_that_waits_for_a_marker(name, tiny_models, close_draft, fresh_heads, tokenizer):  # noqa: F811
    """A grammar that begins after a marker (the end of a thought, under a reasoning parser): each
    row is free up to the marker's first occurrence, then held, exactly as the reference processor
    that does the same; batch 4 and alone. The marker is two tokens of the row's free output."""
    folder = tiny_models["llama"][0]
    drafter = drafters(tiny_models, close_draft, fresh_heads)[name]
    decoder = draftsman.load({"target": {"path": str(folder), "device": target_device(drafter)}, "drafter": drafter})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    free = decoder.generate(input_ids=ids, max_new_tokens=NEW).token_ids
    specs = [dataclasses.replace(StructuredOutput.parse(GRAMMARS["regex"]), after=tuple(row[3:5])) for row in free]
    expected = reference_outputs(folder, tokenizer, ids, specs, decoder.engine.eos_token_ids)
    out = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=specs)
    assert out.token_ids == expected
    assert all(row[:5] == own[:5] for row, own in zip(out.token_ids, free))  # free up to the marker
    assert sum(row != own for row, own in zip(out.token_ids, free)) >= 3  # then held
    for prompt, spec, tokens in zip(ids, specs, expected):
        assert decoder.generate(input_ids=[prompt], max_new_tokens=NEW, structured_output=spec).token_ids[0] == tokens


def test_the_target_drafting_for_itself_is_accepted_where_the_grammar_agrees(tiny_models, tokenizer):
    """The target as its own draft model drafts without the grammar: drafts the grammar forbids are
    rejected, the others accepted, and the output is still plain decoding under the grammar."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)},
                              "drafter": {"name": "draft_model", "path": str(folder), "k": 4}})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    spec = {"regex": r"[a-z_ ():\n]{1,40}"}  # most of what the tiny target writes, not all
    expected = reference_outputs(folder, tokenizer, ids, [spec] * 4, decoder.engine.eos_token_ids, new=32)
    out = decoder.generate(input_ids=ids, max_new_tokens=32, structured_output=spec)
    assert out.token_ids == expected
    unconstrained = decoder.generate(input_ids=ids, max_new_tokens=32)
    assert unconstrained.token_ids != expected  # the grammar changed something
    assert out.stats.tau > 1.5  # drafts are accepted where the grammar lets them


def grammar_part(sequence: list[int], spec: StructuredOutput) -> list[int] | None:
    """What a row's grammar holds of a sequence of new tokens: all of it, or (spec.after) what
    follows the marker's first occurrence; None before it."""
    m = len(spec.after)
    if not m:
        return sequence
    starts = [i for i in range(len(sequence) - m + 1) if tuple(sequence[i:i + m]) == spec.after]
    return sequence[starts[0] + m:] if starts else None


def test_row_grammars_mask_each_node_as_a_fresh_matcher_would(tokenizer):
    """Random trees over a few tokens, rows with their own grammars (or none) and end tokens, one
    whose grammar waits for a marker (a thought's end), several rounds of committed output: each
    valid node's logits are masked exactly as a fresh matcher fed the row's output and the node's
    path (what follows the marker, for that row) masks them, the row's end tokens where the grammar
    may end; a node whose path the grammar forbids, one before the marker, and a row without a
    grammar are untouched."""
    rng = random.Random(0)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    a, b_, c, x = (tokenizer.convert_tokens_to_ids(t) for t in "abcx")
    pool = [a, b_, c, x, eos]
    specs = [StructuredOutput.parse({"regex": "[ab]{1,5}c?"}), None, StructuredOutput.parse({"regex": "(ab|c)+"}),
             StructuredOutput.parse({"choice": ["abc", "ba", "cab"]}),
             dataclasses.replace(StructuredOutput.parse({"regex": "[ab]{1,5}c?"}), after=(c, x))]
    ends = [frozenset({eos}), frozenset({eos}), frozenset({eos, x}), frozenset({eos}), frozenset({eos})]
    grammars = RowGrammars(GrammarCompiler(tokenizer, vocab, {eos}))
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[eos])
    outputs = [[] for _ in specs]
    masked = untouched = waiting = 0
    for _ in range(16):
        block = random_block(rng, len(specs), nodes=7, pool=pool)
        logits = torch.randn(len(specs), block.tokens.shape[1], vocab, generator=torch.Generator().manual_seed(2))
        got = grammars.mask_(logits.clone(), block, [10, 11, 12, 13, 14], outputs, specs, ends)
        for b, spec in enumerate(specs):
            for j in range(block.tokens.shape[1]):
                if not block.valid[b, j]:
                    continue
                path, at = [], j
                while at > 0:
                    path.insert(0, int(block.tokens[b, at]))
                    at = int(block.parents[b, at])
                held = grammar_part(outputs[b] + path, spec) if spec is not None else None
                waiting += spec is not None and held is None
                fresh = llguidance.LLMatcher(lltok, spec.grammar()) if held is not None else None
                below_end = any(t in ends[b] for t in path)
                if fresh is None or below_end or fresh.validate_tokens(held) < len(held):
                    assert torch.equal(got[b, j], logits[b, j]), (b, j)
                    untouched += 1
                    continue
                fresh.consume_tokens(held)
                allowed = allowed_after(fresh, vocab)
                if allowed[eos]:
                    allowed[list(ends[b])] = True
                assert torch.equal(got[b, j], logits[b, j].masked_fill(~allowed, float("-inf"))), (b, j, path)
                masked += 1
        for b, spec in enumerate(specs):  # commit one allowed token a round, as the engine does
            if spec is not None:
                held = grammar_part(outputs[b], spec)
                if held is None:  # before the marker: any token but the end
                    outputs[b].append(rng.choice([c, x] if rng.random() < 0.3 else pool[:4]))
                    continue
                fresh = llguidance.LLMatcher(lltok, spec.grammar())
                fresh.consume_tokens(held)
                choices = [t for t in pool if t != eos and allowed_after(fresh, vocab)[t]]
                outputs[b] += [rng.choice(choices)] if choices else []
    assert masked > 40 and untouched > 20 and waiting > 5, (masked, untouched, waiting)
    assert grammar_part(outputs[4], specs[4]) is not None  # the marked row's grammar began


def test_a_grammar_compiles_once_and_each_row_gets_its_own_matcher(tokenizer, monkeypatch):
    """Rows of one grammar copy its compiled matcher: compiled once for them all (and for the
    request's check), each copy at the start and advanced alone; the least recently used grammar is
    dropped past KEPT_GRAMMARS, and compiled again when asked for."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")
    compiled = []
    compile_ = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, spec: compiled.append(spec) or compile_(self, spec))
    monkeypatch.setattr(GrammarCompiler, "KEPT_GRAMMARS", 2)
    compiler = GrammarCompiler(tokenizer, vocab, {eos})
    ab, abc, choice = (StructuredOutput.parse(v) for v in ({"regex": "(ab)+"}, {"regex": "[abc]+"}, {"choice": ["ca"]}))
    compiler.check(ab)
    rows = [compiler.matcher(ab) for _ in range(3)]
    assert len(compiled) == 1
    assert rows[0].consume_tokens([a, b, a]) and rows[1].consume_tokens([a])
    fresh = llguidance.LLMatcher(compiler.tokenizer(), ab.grammar())
    assert allowed_after(rows[2], vocab).tolist() == allowed_after(fresh, vocab).tolist()  # still at the start
    assert allowed_after(rows[0], vocab)[b] and not allowed_after(rows[0], vocab)[a]
    assert allowed_after(rows[1], vocab)[b] and not allowed_after(rows[1], vocab)[a]
    assert allowed_after(compiler.matcher(ab), vocab)[a]  # a new row starts at the start too
    compiler.matcher(abc), compiler.matcher(ab), compiler.matcher(choice)  # drops abc, used least lately
    assert len(compiled) == 3
    compiler.matcher(ab)
    assert len(compiled) == 3
    assert allowed_after(compiler.matcher(abc), vocab)[c] and len(compiled) == 4


@pytest.fixture(scope="module")
def medium_draft(tiny_models, tmp_path_factory):
    from tiny_models import perturbed_copy
    return perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("medium"), noise=0.3)


@pytest.mark.parametrize("drafter", ["none", "draft_model", "ngram", "eagle3"])
def test_first_two_tokens_follow_the_target_under_the_grammar(drafter, tiny_models, medium_draft, fresh_heads,
                                                              tokenizer):
    """T=1, 6000 rows: the first token and the second (after a first that is not EOS) follow the
    target's distribution restricted to the grammar, computed exactly with fresh matchers. The
    draft model's and EAGLE-3's sampled drafts are drawn within the grammar (their q masked)."""
    folder = tiny_models["llama"][0]
    cfg = {"none": {"name": "none"}, "ngram": {"name": "ngram", "k": 3, "branches": 2},
           "draft_model": {"name": "draft_model", "path": str(medium_draft), "k": 3},
           "eagle3": {"name": "eagle", "path": str(fresh_heads / "eagle3"), "depth": 3}}[drafter]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": cfg})
    spec = {"regex": r"[a-z_ ]{1,10}"}
    prompt = tokenizer("def test(self):\n    self")["input_ids"]
    rows = 6000
    out = decoder.generate(input_ids=[prompt] * rows, max_new_tokens=2, temperature=1.0, seed=7,
                           structured_output=spec)
    eos = sorted(decoder.engine.eos_token_ids)
    model, vocab = load_for_reference(folder), decoder.engine.vocab_size
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    grammar = StructuredOutput.parse(spec).grammar()

    def masked_probs(sequence):
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert matcher.consume_tokens(sequence)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + sequence])).logits[0, -1].double()
        return processed_probs(logits.masked_fill(~allowed_after(matcher, vocab), float("-inf")), SamplingParams(1.0))

    p1 = masked_probs([])
    p2 = torch.zeros_like(p1)
    for first in p1.nonzero().flatten().tolist():
        if first not in eos:
            p2 += p1[first] * masked_probs([first])
    firsts = torch.tensor([t[0] for t in out.token_ids])
    seconds = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert len(seconds) > 0.5 * rows
    assert fit_pvalue(firsts, p1) > ALPHA
    assert fit_pvalue(seconds, p2 / p2.sum()) > ALPHA
    assert (p1 > 0).sum() > 20  # many tokens to choose among, and many forbidden:
    assert (p1 == 0).sum() > vocab / 2
    if drafter in ("draft_model", "eagle3"):
        assert out.stats.tau > 1.02, out.stats.tau  # both the accept and the reject paths run (hundreds of rows each)


def test_rows_with_their_own_grammars_and_a_joining_row(tiny_models, tokenizer):
    """A batch whose rows have a grammar each or none gives each row its lone output; a row that
    joins a running batch with its own grammar too."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    decoder.engine.join_prefill_chunk = 2
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    specs = [GRAMMARS["regex"], None, GRAMMARS["choice"], GRAMMARS["json"]]
    lone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, structured_output=s).token_ids[0]
            for p, s in zip(ids, specs)]
    assert decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=specs).token_ids == lone
    rounds = [0]

    def joins():
        rounds[0] += 1
        return [JoiningPrompt(ids[3], NEW, warpers={"structured_output": GRAMMARS["json"]})] if rounds[0] == 3 else []

    tokens: dict[int, list[int]] = {}
    for row, chunk in decoder.stream_batch(ids[:2], joining=joins, max_new_tokens=NEW, structured_output=specs[0]):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    regex_alone = [decoder.generate(input_ids=[p], max_new_tokens=NEW, structured_output=specs[0]).token_ids[0]
                   for p in ids[:2]]
    assert [tokens[0], tokens[1], tokens[2]] == [*regex_alone, lone[3]]


def test_stop_token_ids_end_a_row_where_its_grammar_may_end(tiny_models, tokenizer):
    """A row's stop token is allowed exactly where its grammar may end: it ends the row there."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}})
    ids = [tokenizer("def test(self):\n    ")["input_ids"]]
    stop = tokenizer.convert_tokens_to_ids("x")
    spec = {"regex": "[a-c]{3}"}
    out = decoder.generate(input_ids=ids, max_new_tokens=8, structured_output=spec, stop_token_ids=[stop],
                           logit_bias={stop: 100})  # the stop token is the likeliest wherever allowed
    assert out.token_ids[0][-1] == stop and len(out.token_ids[0]) == 4 and out.stats.finish_reasons == ["stop"]
    assert re.fullmatch("[a-c]{3}", tokenizer.decode(out.token_ids[0][:3]))


@pytest.mark.parametrize("value, message", [
    ({"jsn": {}}, "exactly one of ['choice', 'grammar', 'json', 'json_object', 'regex']"),
    ({"json": {}, "regex": "a"}, "exactly one of"),
    ({"json": {}, "strict": True}, "unknown key(s) ['strict']"),
    ({"json": "{not json"}, "text that is not JSON"),
    ({"json": [1]}, "must be a JSON schema"),
    ({"json_object": "yes"}, "json_object must be true"),
    ({"choice": []}, "non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"regex": "a", "disable_any_whitespace": True}, "with json or json_object"),
    ("json", "must be a dict"),
])
def test_malformed_structured_output_is_refused(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_output=value)


def test_bad_grammars_and_conflicts_are_refused_before_generating(tiny_models, tokenizer):
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}})
    ids = [tokenizer("x")["input_ids"]]
    for spec, message in [({"regex": "[0-9"}, "unclosed character class"),
                          ({"grammar": "start: foo"}, 'unknown name: "foo"'),
                          ({"json": {"type": "nonsense"}}, "does not compile")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            decoder.generate(input_ids=ids, max_new_tokens=4, structured_output=spec)
    with pytest.raises(ValueError, match=r"min_new_tokens=2 \(row 0\) holds EOS back: drop one"):
        decoder.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=2, structured_output={"regex": "a+"})
    with pytest.raises(ValueError, match=r"ignore_eos \(row 1\) holds EOS back"):
        decoder.generate(input_ids=ids * 2, max_new_tokens=4, ignore_eos=[False, True],
                         structured_output=[None, {"regex": "a+"}])
    decoder.engine.grammars = None  # as for a target folder without a tokenizer
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        decoder.generate(input_ids=ids, max_new_tokens=4, structured_output={"regex": "a+"})


def test_the_config_takes_a_structured_output(tiny_models, tokenizer):
    folder = str(tiny_models["llama"][0])
    decoder = draftsman.load({"target": {"path": folder}, "sampling": {"structured_output": {"choice": ["pass"]}}})
    assert decoder.generate(input_ids=[tokenizer("x")["input_ids"]], max_new_tokens=8).texts == ["pass"]
    with pytest.raises(ValueError, match=r"sampling.structured_output must be a dict with exactly one of"):
        draftsman.load({"target": {"path": folder}, "sampling": {"structured_output": {"choices": ["a"]}}})
    with pytest.raises(ValueError, match=r"sampling.structured_output"):
        draftsman.load({"target": {"path": folder}, "sampling": {"structured_output": "json"}})


def test_the_command_line_takes_a_structured_output(tiny_models, tokenizer, capsys):
    """`draftsman generate --structured-output JSON` gives generate's output; a malformed one exits
    2 before any model loads; the audit refuses a config that sets one."""
    from draftsman import cli

    folder = str(tiny_models["llama"][0])
    spec = GRAMMARS["regex"]
    assert cli.main(["generate", "--set", f"target.path={folder}", "--set", "drafter.name=ngram",
                     "--input-ids", ",".join(map(str, tokenizer(PROMPTS[0])["input_ids"])),
                     "--max-new-tokens", str(NEW), "--structured-output", json.dumps(spec), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = draftsman.load({"target": {"path": folder}, "drafter": {"name": "ngram"}}).generate(
        [PROMPTS[0]], max_new_tokens=NEW, structured_output=spec)
    assert got["token_ids"] == want.token_ids and re.fullmatch(spec["regex"], want.texts[0])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--set", f"target.path={folder}", "--prompt", "x", "--structured-output",
                  '{"regexp": "a"}'])
    assert exit_.value.code == 2 and "exactly one of" in capsys.readouterr().err
    code = cli.main(["audit", "--set", f"target.path={folder}", "--set",
                     'sampling.structured_output={"regex": "a+"}', "--samples", "10"])
    assert code == 2 and "does not take sampling.structured_output" in capsys.readouterr().err


def test_logprobs_under_a_grammar(tiny_models, tokenizer):
    """Raw logprobs are the target's own distribution (before the grammar), processed ones the
    distribution the token was drawn from (after it): each token's processed log-probability is
    its raw one renormalised over what the grammar allowed, so it is the larger."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    prompt = tokenizer(PROMPTS[1])["input_ids"]
    spec = GRAMMARS["regex"]
    raw = decoder.generate(input_ids=[prompt], max_new_tokens=NEW, structured_output=spec, logprobs=True)
    processed = decoder.generate(input_ids=[prompt], max_new_tokens=NEW, structured_output=spec, logprobs="processed")
    tokens = raw.token_ids[0]
    with torch.no_grad():
        logits = load_for_reference(folder)(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    own = logits.double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert raw.logprobs[0] == pytest.approx(own.tolist(), abs=1e-4)
    assert all(p >= r - 1e-6 for p, r in zip(processed.logprobs[0], raw.logprobs[0]))
    assert sum(p > r + 1e-3 for p, r in zip(processed.logprobs[0], raw.logprobs[0])) >= 3  # the mask renormalised


def test_disable_any_whitespace_leaves_only_the_separators(tiny_models, tokenizer):
    """JSON under disable_any_whitespace holds no whitespace but ", " and ": " (the schema has no
    free strings); without it the tiny target fills JSON with whitespace."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    compact = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output=GRAMMARS["json"])
    loose = decoder.generate(input_ids=ids, max_new_tokens=NEW, structured_output={"json": SCHEMA})
    assert all(re.search(r"\s", text.replace(", ", "").replace(": ", "")) is None for text in compact.texts)
    assert sum(re.search(r"\s", text.replace(", ", "").replace(": ", "")) is not None for text in loose.texts) >= 2


def test_a_joining_row_is_refused_as_a_new_one(tiny_models, tokenizer):
    """A row joining a running batch (or checked before it joins) with a grammar and a minimum is
    refused as generate refuses it."""
    folder = tiny_models["llama"][0]
    decoder = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with pytest.raises(ValueError, match=r"min_new_tokens=2 \(row 0\) holds EOS back"):
        decoder.check_join([ids[0]], NEW, min_new_tokens=2, structured_output=GRAMMARS["regex"])
    joining = [JoiningPrompt(ids[1], NEW, min_new_tokens=2, warpers={"structured_output": GRAMMARS["regex"]})]
    with pytest.raises(ValueError, match=r"min_new_tokens=2 \(row 0\) holds EOS back"):
        for _ in decoder.stream_batch(ids[:1], joining=lambda: [joining.pop()] if joining else [], max_new_tokens=NEW):
            pass
