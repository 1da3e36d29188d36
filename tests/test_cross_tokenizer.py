"""`cross_tokenizer`: a draft model with a tokenizer of its own drafts through text. Exact: greedy
output is the target's own at batch 1 and 4, and at T=1 the first two tokens follow the target's
marginals. Useful: the bundled draft model under shuffled ids keeps the tau it has as
`draft_model`. Its cache, kept across rounds, drafts what a fresh one would, and past the draft
model's context it is rebuilt once per stride of ids, not every round. Bad folders are named."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import draftsman
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import ALPHA, ROWS, exact_marginals, fit_pvalue
from tiny_models import (build_model_folder, build_tokenizer, load_for_reference, perturbed_copy,
                         permuted_vocab_copy)

NEW = 32
TEXTS = ["def parse(", "class Foo:\n    def", "for i in range(10):\n    print(i", "import"]
ZOO = Path(__file__).resolve().parent.parent / "zoo"


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    """Per arch: the target's close copy under shuffled ids, and a Qwen2 draft model with a
    tokenizer trained to another vocabulary (other merges, other ids)."""
    root = tmp_path_factory.mktemp("cross")
    other = build_tokenizer(root / "other-tokenizer", vocab_size=280)
    out = {}
    for arch, (target, _) in tiny_models.items():
        close = perturbed_copy(target, root / f"{arch}-close", noise=0.05)
        out[arch] = {"shuffled": permuted_vocab_copy(close, root / f"{arch}-shuffled"),
                     "other": build_model_folder(root / f"{arch}-other", "qwen2", seed=5, size="draft",
                                                 tokenizer=other)}
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_output_is_the_targets_own(arch, tiny_models, tiny_tokenizer, drafts):
    target = tiny_models[arch][0]
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in TEXTS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]
    configs = {kind: {"name": "cross_tokenizer", "path": str(folder), "k": 4} for kind, folder in drafts[arch].items()}
    configs["adaptive"] = {**configs["shuffled"], "adaptive": True}  # its depth limit cuts the chain
    for kind, cfg in configs.items():
        dec = draftsman.load({"target": {"path": str(target)}, "drafter": cfg})
        assert [dec.generate(input_ids=[p], max_new_tokens=NEW).token_ids[0] for p in prompts] == expected, kind
        batched = dec.generate(input_ids=prompts, max_new_tokens=NEW)
        assert batched.token_ids == expected, kind
        assert batched.stats.proposed_tokens > 0 or kind == "adaptive", kind  # it drafted (adaptive may not)


def test_past_its_context_the_draft_model_reads_a_window_moved_a_stride_at_a_time(tiny_models, tiny_tokenizer,
                                                                                  drafts, tmp_path):
    """A draft model whose context is shorter than the row's text drafts from a window of its latest
    ids. The window's start moves a quarter of the room at a time, so the draft cache is rebuilt
    once per stride of new ids, not every round (as when the start moved with every new id), and
    the window keeps at least three quarters of the room. The output stays the target's own."""
    target = tiny_models["llama"][0]
    short = tmp_path / "short-context"
    shutil.copytree(drafts["llama"]["shuffled"], short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT = 40
    (short / "config.json").write_text(json.dumps(config))
    prompt = tiny_tokenizer(" ".join(TEXTS) * 3)["input_ids"]
    model = load_for_reference(target)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "cross_tokenizer", "path": str(short), "k": 4}})
    drafter = dec.engine.drafter
    windows, rebuilt = [], [0]  # (the row's ids, the window's), per round; rounds that fed the cache from empty
    draft_ids, rollback = drafter._draft_ids, drafter.lm.rollback

    def recording_ids(b, context):
        ids = draft_ids(b, context)
        windows.append((len(drafter.text_ids.rows[b].ids), len(ids)))
        return ids

    def recording_rollback(lengths):
        rebuilt[0] += int((lengths == 0).sum())
        return rollback(lengths)

    drafter._draft_ids, drafter.lm.rollback = recording_ids, recording_rollback
    assert dec.generate(input_ids=[prompt], max_new_tokens=48).token_ids[0] == expected
    room, stride = CONTEXT - 4, (CONTEXT - 4) // 4
    assert windows[0][0] > room, windows[0]  # the prompt alone overflows it
    assert all(room - stride < window <= room for _, window in windows), windows
    growth = windows[-1][0] - windows[0][0]
    assert len(windows) > 8 and growth > 2 * stride, windows
    assert rebuilt[0] <= growth / stride + 2 and rebuilt[0] < len(windows) / 2, (rebuilt, windows)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=20, top_p=0.9)],
                         ids=["T1", "T0.7_topk20_topp0.9"])
def test_first_two_tokens_follow_the_target(params, tiny_models, tiny_tokenizer, tmp_path_factory):
    """Sampled rounds draw among the tokens both vocabularies share, with q: a perturbed copy of
    the target under shuffled ids (only text and token spellings link the two)."""
    target = tiny_models["llama"][0]
    root = tmp_path_factory.mktemp("medium")
    medium = permuted_vocab_copy(perturbed_copy(target, root / "medium", noise=0.3), root / "shuffled")
    prompt = tiny_tokenizer("def parse(text):")["input_ids"]  # as the tokenizer writes it: the text round trip keeps it
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "cross_tokenizer", "path": str(medium), "k": 3}})
    out = dec.generate(input_ids=[prompt] * ROWS, max_new_tokens=2, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, seed=11)
    accepted = 2 - 2 / out.stats.tau  # rows whose first draft was accepted (one round, not two)
    assert 0.03 < accepted < 0.97, "both accept and reject paths must be exercised"
    assert out.stats.drafter_report["shared_tokens"] == len(tiny_tokenizer)
    p1, p2 = exact_marginals(load_for_reference(target), prompt, params, dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert len(second) > 0.9 * ROWS
    assert fit_pvalue(first, p1) > ALPHA
    assert fit_pvalue(second, p2) > ALPHA


def zoo_or_skip():
    if not (ZOO / "python-draft" / "config.json").is_file():
        pytest.skip("zoo/python-draft not trained yet (make zoo)")


ZOO_PROMPTS = ["def parse(text):\n    \"\"\"Split", "import os\n\n\ndef main():\n",
               "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def zoo_shuffled(tmp_path_factory):
    zoo_or_skip()
    return permuted_vocab_copy(ZOO / "python-draft", tmp_path_factory.mktemp("zoo-shuffled"))


def test_the_bundled_draft_model_under_shuffled_ids_keeps_its_tau(zoo_shuffled):
    """The same draft model as `draft_model` (the target's ids) and as `cross_tokenizer` (its
    ids shuffled, so only text links the two): the text bridge loses little. Measured when
    written: tau 6.60 against 6.81 summed over the three prompts."""
    base = draftsman.load({"target": {"path": str(ZOO / "python-target")}})
    plain = base.generate(ZOO_PROMPTS, max_new_tokens=48).token_ids
    tau = {}
    for name, folder in (("draft_model", ZOO / "python-draft"), ("cross_tokenizer", zoo_shuffled)):
        dec = base.with_drafter({"name": name, "path": str(folder), "k": 4})
        outs = [dec.generate([p], max_new_tokens=48) for p in ZOO_PROMPTS]
        assert [o.token_ids[0] for o in outs] == plain, name
        tau[name] = sum(o.stats.tau for o in outs)
        if name == "cross_tokenizer":
            report = [o.stats.drafter_report for o in outs]
            assert sum(r["bridged_rounds"] for r in report) > 5 * sum(r["text_alone_rounds"] for r in report)
    assert tau["cross_tokenizer"] > 0.9 * tau["draft_model"] > 0.9 * 1.5 * len(ZOO_PROMPTS), tau


def test_a_cache_kept_across_rounds_drafts_what_a_fresh_one_would(zoo_shuffled):
    """Each round keeps the longest prefix of its ids the draft cache already holds; recomputing
    every row from scratch each round drafts the same trees. Rows end apart and one joins the
    batch, and before every round each row's cache holds as many ids as the drafter says it does."""
    base = draftsman.load({"target": {"path": str(ZOO / "python-target")}})
    dec = base.with_drafter({"name": "cross_tokenizer", "path": str(zoo_shuffled), "k": 4})
    drafter = dec.engine.drafter
    joiner = dec.encode(["def main():\n    for"])[0]
    trees = {}
    for fresh in (False, True):
        seen, propose, rounds = {}, type(drafter).propose, [0]

        def recording(contexts, seen=seen, fresh=fresh):
            assert drafter.lm.lengths.tolist() == [len(ids) for ids in drafter.held]
            if fresh:  # forget every row's cache: it is rebuilt from the row's whole text
                drafter.lm.reset(len(contexts))
                drafter.held = [[] for _ in contexts]
            out = propose(drafter, contexts)
            seen.update({tuple(c): t.tokens.tolist() for c, t in zip(contexts, out)})
            return out

        def joining():
            rounds[0] += 1
            return [(joiner, 24)] if rounds[0] == 3 else []

        drafter.propose = recording
        stats = draftsman.GenerationStats()
        emitted = sum(len(chunk.token_ids) for _, chunk in dec.stream_batch(
            dec.encode(ZOO_PROMPTS), stats=stats, joining=joining, max_new_tokens=[40, 16, 48]))
        trees[fresh] = seen
        assert rounds[0] >= 3 and emitted > 100 and stats.tau > 1.5
    del drafter.propose
    assert trees[False] == trees[True]


def test_drafts_are_cut_before_what_the_grammar_forbids(zoo_shuffled):
    """Under structured output a chain ends before its first token the row's grammar forbids
    (checked with a fresh matcher per node); left free, the same drafter drafts forbidden tokens.
    The output is plain decoding's under the grammar either way."""
    from transformers import AutoTokenizer

    from test_grammar_drafts import grammar_checks, record_with_q, vocab

    base = draftsman.load({"target": {"path": str(ZOO / "python-target")}})
    dec = base.with_drafter({"name": "cross_tokenizer", "path": str(zoo_shuffled), "k": 4})
    no_strings = {"regex": "[^'\"#\\x00]{0,400}"}  # code without string literals or comments
    ids = dec.encode(ZOO_PROMPTS)
    plain = base.generate(input_ids=ids, max_new_tokens=48, structured_output=no_strings).token_ids
    tokenizer = AutoTokenizer.from_pretrained(ZOO / "python-target")
    found = {}
    for within in (True, False):
        dec.engine.draft_within_grammar = within
        seen = record_with_q(dec)
        out = dec.generate(input_ids=ids, max_new_tokens=48, structured_output=no_strings)
        del dec.engine.drafter.propose
        assert out.token_ids == plain, within
        found[within] = grammar_checks(seen, ids, [no_strings] * len(ids), tokenizer, vocab(dec),
                                       dec.engine.eos_token_ids)
    (held, forbidden, _), (_, free_forbidden, _) = found[True], found[False]
    assert held > 50 and forbidden == 0, found
    assert free_forbidden > 0, found


def test_compare_runs_transformers_universal_assisted_generation_beside_it(tiny_models, tiny_tokenizer, drafts):
    """`draftsman compare` with a cross_tokenizer drafter adds Hugging Face's own drafting through
    another tokenizer (assistant_model + tokenizer + assistant_tokenizer) as a peer, whose greedy
    output is plain decoding's too."""
    from draftsman.bench.peers import build_peers

    target, other = tiny_models["llama"][0], drafts["llama"]["other"]
    decoder = draftsman.load({"target": {"path": str(target)}})
    cfg = {"name": "cross_tokenizer", "path": str(other), "k": 4}
    peers = {p.label: p for p in build_peers(decoder, [cfg])[0]}
    assert set(peers) == {"hf_generate", "hf_universal_assisted", "hf_prompt_lookup"}
    universal = peers["hf_universal_assisted"]
    assert universal.settings["assistant_tokenizer"] == str(other) and universal.extra_parameters > 0
    prompt = tiny_tokenizer(TEXTS[1])["input_ids"]
    plain = peers["hf_generate"].run([prompt], NEW, 0.0, 0).tokens
    assert universal.run([prompt], NEW, 0.0, 0).tokens == plain
    assert decoder.with_drafter(cfg).generate(input_ids=[prompt], max_new_tokens=NEW).token_ids == plain


def test_bad_folders_and_options_are_named(tiny_models, drafts, tmp_path):
    target = str(tiny_models["llama"][0])
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(drafts["llama"]["other"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no tokenizer files .* add its own tokenizer"):
        draftsman.load({"target": {"path": target}, "drafter": {"name": "cross_tokenizer", "path": str(no_tokenizer)}})
    with pytest.raises(ValueError, match="drafts through text as drafter `cross_tokenizer`"):
        draftsman.load({"target": {"path": target}, "drafter": {"name": "draft_model",
                                                                "path": str(drafts["llama"]["other"])}})
    with pytest.raises(ValueError, match="k must be >= 1"):
        draftsman.load({"target": {"path": target}, "drafter": {"name": "cross_tokenizer",
                                                                "path": str(drafts["llama"]["other"]), "k": 0}})
    with pytest.raises(FileNotFoundError, match="cross_tokenizer: drafter.path .* does not exist"):
        draftsman.load({"target": {"path": target},
                        "drafter": {"name": "cross_tokenizer", "path": str(tmp_path / "no")}})
    with pytest.raises(ValueError, match="set drafter.path"):
        draftsman.load({"target": {"path": target}, "drafter": {"name": "cross_tokenizer"}})
    with pytest.raises(ValueError, match="k=256 leaves no room in the draft model's context of 256 positions"):
        draftsman.load({"target": {"path": target},
                        "drafter": {"name": "cross_tokenizer", "path": str(drafts["llama"]["other"]), "k": 256}})
