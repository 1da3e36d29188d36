"""`draft_model` with `draft_vocab`: its LM head keeps N rows, so a drafted token is an index into
those rows that must be mapped back to a token id, and a sampled draft's q lives on N tokens that
must be placed in the full vocabulary. Greedy output equals the target's, sampled output follows
the target's marginals, a misplaced q is caught, and `draftsman vocab` writes the order."""
import json
import shutil

import pytest
import torch

import draftsman
from draftsman import cli
from draftsman.drafters import check_drafter_config
from draftsman.drafters import draft_model as draft_model_module
from draftsman.drafters.draft_vocab import read_token_order
from draftsman.drafters.int8_linear import Int8Linear
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import ALPHA, PROMPT, ROWS, exact_marginals, fit_pvalue
from tiny_models import load_for_reference, perturbed_copy, target_device

NEW_TOKENS = 30
PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 8], [1, 2, 3, 4, 5, 1, 2, 3, 4], [60, 61, 62, 63]]


def write_order(folder, order):
    (folder / "tokens_by_frequency.json").write_text(json.dumps({"tokens_by_frequency": order}))


@pytest.fixture(scope="module")
def greedy_case(tiny_models, tmp_path_factory):
    """A draft model close to the llama target whose order file leads with the tokens the target
    emits on PROMPTS, then the rest (a stand-in for counting its picks on training text)."""
    target = tiny_models["llama"][0]
    model = load_for_reference(target)
    expected = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))
        expected.append(out[0, len(p):].tolist())
    V = model.config.vocab_size
    emitted = list(dict.fromkeys(t for row in expected for t in row))
    draft = perturbed_copy(target, tmp_path_factory.mktemp("close-vocab"), noise=0.05)
    write_order(draft, emitted + [t for t in reversed(range(V)) if t not in set(emitted)])
    return target, draft, expected, len(emitted)


def load(target, **drafter):
    return draftsman.load({"target": {"path": str(target), "device": target_device(drafter)},
                           "drafter": {"name": "draft_model", "k": 4, **drafter},
                           "generation": {"max_new_tokens": NEW_TOKENS}})


@pytest.mark.parametrize("extra, min_tau", [({}, 2.0), ({"top_k": 3, "total_tokens": 8}, 2.0),
                                            ({"min_confidence": 0.6}, 1.5)],  # rows stop early: shorter drafts
                         ids=["chain", "tree", "confidence"])
def test_greedy_output_equals_the_target(greedy_case, extra, min_tau):
    target, draft, expected, n = greedy_case
    dec = load(target, path=str(draft), draft_vocab=n + 4, **extra)
    assert dec.drafter.lm.model.get_output_embeddings().weight.shape[0] == n + 4  # the head did shrink
    batched = dec.generate(input_ids=PROMPTS, temperature=0.0)
    assert batched.token_ids == expected
    assert [dec.generate(input_ids=[p], temperature=0.0).token_ids[0] for p in PROMPTS] == expected
    # Drafts are mapped from head rows back to token ids: unmapped, almost none would be accepted.
    assert batched.stats.tau > min_tau, batched.stats.tau


@pytest.mark.parametrize("extra", [{}, {"draft_vocab_sampling": True}], ids=["two_heads", "one_head"])
def test_an_int8_draft_model_quantizes_every_product_and_keeps_the_output(greedy_case, extra):
    """quantize: int8 converts the decoder layers and each LM head a round reads (draft_vocab's
    rows for greedy rounds, the whole head for sampled ones, or one shared), and counts the
    parameters as loaded."""
    target, draft, expected, n = greedy_case
    float_dec = load(target, path=str(draft), draft_vocab=n + 4, **extra)
    dec = load(target, path=str(draft), draft_vocab=n + 4, quantize="int8", **extra)
    model = dec.drafter.lm.model
    assert not [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    greedy_head, sampled_head = (dec.drafter.output_layers[g][0] for g in (True, False))
    assert isinstance(greedy_head, Int8Linear) and isinstance(sampled_head, Int8Linear)
    assert greedy_head.out_features == n + 4
    assert (greedy_head is sampled_head) == bool(extra)
    assert dec.drafter.extra_parameters() == float_dec.drafter.extra_parameters()
    out = dec.generate(input_ids=PROMPTS, temperature=0.0)
    assert out.token_ids == expected
    assert out.stats.tau > 2.0, out.stats.tau


def test_an_int8_draft_models_sampled_q_is_what_the_int8_model_computed(greedy_case):
    """The verifier's p/q ratios need the distribution a token was really drawn from: the int8
    model's, which differs from the float32 model's by more than the tolerance used here. (int8
    activations are scaled per call, so the reference runs the LM head on the last position only,
    as drafting does.)"""
    target, draft, _, _ = greedy_case
    drafter = load(target, path=str(draft), quantize="int8").drafter
    context = PROMPTS[0]
    drafter.begin([context], SamplingParams(1.0), torch.Generator().manual_seed(0))
    q = drafter.propose([context])[0].draft_probs[0].double()  # the first draft token's q
    ids = torch.tensor([context])
    with torch.no_grad():
        int8_p = drafter.lm.model(input_ids=ids, logits_to_keep=1).logits[0, -1].double().softmax(-1)
        float_p = load_for_reference(draft)(input_ids=ids).logits[0, -1].double().softmax(-1)
    assert (q - int8_p).abs().max() < 1e-5
    assert (q - float_p).abs().max() > 1e-4


def test_tokens_outside_the_draft_vocabulary_still_come_from_the_target(greedy_case):
    """A draft vocabulary that misses most emitted tokens costs acceptance, never output."""
    target, draft, expected, n = greedy_case
    dec = load(target, path=str(draft), draft_vocab=max(1, n // 4))
    assert dec.generate(input_ids=PROMPTS, temperature=0.0).token_ids == expected


@pytest.fixture(scope="module")
def sampling_case(tiny_models, tmp_path_factory):
    """A medium draft model and an order led by the target's most likely first tokens at PROMPT."""
    target = tiny_models["llama"][0]
    draft = perturbed_copy(target, tmp_path_factory.mktemp("medium-vocab"), noise=0.3)
    with torch.no_grad():
        logits = load_for_reference(target)(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    write_order(draft, logits.argsort(descending=True).tolist())
    return target, draft


def sample(target, draft, params):
    dec = draftsman.load({"target": {"path": str(target)},
                          "drafter": {"name": "draft_model", "path": str(draft), "k": 3, "draft_vocab": 40,
                                      "draft_vocab_sampling": True}})
    out = dec.generate(input_ids=[PROMPT] * ROWS, max_new_tokens=2, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, seed=123)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    p1, p2 = exact_marginals(load_for_reference(target), PROMPT, params, dec.engine.eos_token_ids)
    return out, fit_pvalue(first, p1), fit_pvalue(second, p2)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.9, top_k=20, top_p=0.9)],
                         ids=["T1", "T0.9_topk20_topp0.9"])
def test_sampling_follows_the_target(sampling_case, params):
    out, p_first, p_second = sample(*sampling_case, params)
    assert out.stats.tau > 1.05, "both accept and reject paths must be exercised"
    assert p_first > ALPHA and p_second > ALPHA


def test_sampled_rounds_keep_the_whole_head_unless_asked(greedy_case):
    """The order counts greedy picks; sampled tokens spread beyond them, so by default a sampled
    request drafts from the whole vocabulary and the next greedy one from the N rows again."""
    target, draft, expected, n = greedy_case
    dec = load(target, path=str(draft), draft_vocab=n)
    width = lambda: dec.drafter.lm.model.get_output_embeddings().weight.shape[0]  # noqa: E731
    dec.generate(input_ids=PROMPTS, temperature=1.0, seed=1)
    assert width() == load_for_reference(target).config.vocab_size and dec.drafter.vocab_map is None
    assert dec.generate(input_ids=PROMPTS, temperature=0.0).token_ids == expected
    assert width() == n


def test_a_misplaced_q_is_caught(sampling_case, monkeypatch):
    """The broken variant: q placed on the wrong token ids (shifted by one row of the map). The
    verifier then divides by the wrong probabilities and the output leaves the target's law."""
    def misplaced(probs, vocab_map, vocab_size):
        return probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, vocab_map.roll(1), probs)

    monkeypatch.setattr(draft_model_module, "full_vocab", misplaced)
    _, p_first, _ = sample(*sampling_case, SamplingParams(1.0))
    assert p_first < ALPHA


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("options, message", [
    ({"vocab_order": "x"}, "vocab_order only applies with draft_vocab; set draft_vocab too"),
    ({"draft_vocab_sampling": True}, "draft_vocab_sampling only applies with draft_vocab"),
    ({"draft_vocab": 8}, r"draft_vocab needs token frequencies, and '.*' has neither tokens_by_frequency.json"
                         r" nor a config.json with tokens_by_frequency; write one with `draftsman vocab"),
    ({"draft_vocab": 8, "vocab_order": "/no/such/order.json"}, "vocab_order '/no/such/order.json' does not exist"),
])
def test_bad_draft_vocab_settings_name_the_fix(tiny_models, options, message):
    target, draft = tiny_models["llama"]
    with pytest.raises(ValueError, match=message):
        load(target, path=str(draft), **options)


def test_an_order_counted_for_another_vocabulary_is_refused(tiny_models, tmp_path):
    target, _ = tiny_models["llama"]
    order = tmp_path / "order.json"
    order.write_text(json.dumps({"tokens_by_frequency": list(range(100_000))}))
    with pytest.raises(ValueError, match="counted for another vocabulary .token ids up to 99999; the target has"):
        load(target, path=str(tiny_models["llama"][1]), draft_vocab=8, vocab_order=str(order))


def test_a_vocab_order_that_is_not_json_names_the_key_the_file_and_the_fix(tiny_models, tmp_path):
    """It was json's bare "Extra data: line 2 column 1 (char 208)", naming neither (a JSONL file, a
    damaged tokens_by_frequency.json or heads config.json in a folder)."""
    target, draft = tiny_models["llama"]
    jsonl = tmp_path / "regen.jsonl"
    jsonl.write_text('{"a": 1}\n{"a": 2}\n')
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokens_by_frequency.json").write_text('{"tokens_by_frequency": [1, 2')
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_bytes(b"\xff\xfe not text")
    for source, bad in ((jsonl, jsonl), (folder, folder / "tokens_by_frequency.json"), (heads, heads / "config.json")):
        with pytest.raises(ValueError, match=rf"^draft_model: vocab_order: '{bad}' is not valid JSON .*; point "
                                             r"vocab_order at the token order `draftsman vocab"):
            read_token_order(str(source), 320, "draft_model")


def test_an_order_recorded_for_another_target_is_refused(tiny_models, tmp_path):
    """A heads folder's config.json and a `draftsman vocab` file record the target's fingerprint: an
    order of another target (even of the same vocabulary) is refused; one without a record loads."""
    from draftsman.heads.common import target_fingerprint

    llama, qwen2 = (load_for_reference(tiny_models[arch][0]) for arch in ("llama", "qwen2"))
    order = list(range(llama.config.vocab_size))
    for name, record in (("heads", "config.json"), ("counted", "tokens_by_frequency.json")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / record).write_text(json.dumps({"tokens_by_frequency": order, "target": target_fingerprint(qwen2)}))
        with pytest.raises(ValueError, match=rf"vocab_order '{folder / record}' was trained for another target: "
                                             r"architecture is 'Qwen2ForCausalLM' in the record"):
            read_token_order(str(folder), len(order), "draft_model", target_model=llama)
        (folder / record).write_text(json.dumps({"tokens_by_frequency": order, "target": target_fingerprint(llama)}))
        assert read_token_order(str(folder), len(order), "draft_model", target_model=llama) == order
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"tokens_by_frequency": order, "counted_on": "greedy picks of llama"}))
    assert read_token_order(str(old), len(order), "draft_model", target_model=llama) == order


def test_the_drafters_refuse_an_order_counted_for_another_target(greedy_case, tiny_models, tmp_path):
    """The check above, where the drafters read vocab_order (draft_model; mlp_speculator and native_mtp
    call read_token_order the same way)."""
    from draftsman.heads.common import target_fingerprint

    target, draft, _, _ = greedy_case
    qwen2 = load_for_reference(tiny_models["qwen2"][0])
    order = list(range(qwen2.config.vocab_size))
    other = tmp_path / "tokens_by_frequency.json"
    other.write_text(json.dumps({"tokens_by_frequency": order, "target": target_fingerprint(qwen2)}))
    with pytest.raises(ValueError, match="was trained for another target"):
        load(target, path=str(draft), draft_vocab=8, vocab_order=str(other))


@pytest.mark.parametrize("with_order", [True, False], ids=["order_file", "no_order_file"])
def test_draft_vocab_must_fit_the_vocabulary(greedy_case, tiny_models, with_order):
    """Named as the count it is, whether or not the draft model's folder has an order to read."""
    target, draft, _, _ = greedy_case
    draft = draft if with_order else tiny_models["llama"][1]
    with pytest.raises(ValueError, match=r"^draft_model: draft_vocab must be between 1 and the vocabulary size \d+, "
                                         r"got 1000000: set it to at most \d+, or leave it unset"):
        load(target, path=str(draft), draft_vocab=10 ** 6)


@pytest.mark.parametrize("drafter", ["draft_model", "native_mtp"])
@pytest.mark.parametrize("count", [0, -1])
def test_a_draft_vocab_below_1_is_named_before_the_target_loads(tiny_models, drafter, count):
    """Options shared by the drafters that read draft_vocab: the check that runs before the target
    loads names it (no target here), before any missing order."""
    folder = {"path": str(tiny_models["llama"][1])} if drafter == "draft_model" else {"vocab_order": "/no/order"}
    with pytest.raises(ValueError, match=rf"^{drafter}: draft_vocab must be >= 1 \(the number of tokens the target "
                                         rf"picks most to draft among\), got {count}: set a positive count"):
        check_drafter_config({"name": drafter, "draft_vocab": count, **folder})


# ----------------------------------------------------------------------------- draftsman vocab

def test_the_vocab_command_writes_the_order_a_draft_model_reads(tiny_models, tiny_corpus, tmp_path, capsys):
    target, draft = tiny_models["llama"]
    folder = shutil.copytree(draft, tmp_path / "draft")
    code = cli.main(["vocab", "--target", str(target), "--out", str(folder), "--corpus-root", str(tiny_corpus),
                     "--work-dir", str(tmp_path / "work"), "--tokens", "2048", "--seq-len", "64", "--threads", "1"])
    assert code == 0 and "coverage" in capsys.readouterr().out
    written = json.loads((folder / "tokens_by_frequency.json").read_text())
    assert written["target"]["architecture"] == "LlamaForCausalLM"  # the fingerprint a drafter checks
    V = load_for_reference(target).config.vocab_size
    assert sorted(written["tokens_by_frequency"]) == list(range(V))  # every token, once
    assert set(written["coverage"]) == {"256", "1024", "2048", "4096"}
    dec = load(target, path=str(folder), draft_vocab=16)  # read from the folder by default
    expected = written["tokens_by_frequency"][:16]
    assert sorted(dec.drafter.vocab_map.tolist()) == sorted(expected)
    # A rerun writes over the order it wrote, a new folder is made; a file that holds no order is
    # refused before the count.
    for out in (folder, tmp_path / "new" / "folder" / "order.json"):
        assert cli.main(["vocab", "--target", str(target), "--out", str(out), "--corpus-root", str(tiny_corpus),
                         "--work-dir", str(tmp_path / "work"), "--tokens", "1024", "--seq-len", "64"]) == 0
    assert "tokens_by_frequency" in json.loads((tmp_path / "new" / "folder" / "order.json").read_text())
    # "newdir/" wrote a file named newdir; more tokens than the corpus has were recorded as counted
    assert cli.main(["vocab", "--target", str(target), "--out", f"{tmp_path / 'newdir'}/", "--corpus-root",
                     str(tiny_corpus), "--work-dir", str(tmp_path / "work"), "--tokens", "10000000",
                     "--seq-len", "64"]) == 0
    counted_on = json.loads((tmp_path / "newdir" / "tokens_by_frequency.json").read_text())["counted_on"]
    counted = int(counted_on.split(" on ")[1].split()[0])
    assert 64 <= counted < 10000000 and counted % 64 == 0, counted_on
    capsys.readouterr()
    config = (folder / "config.json").read_bytes()
    for out in (folder / "config.json", folder / "model.safetensors"):
        before = out.read_bytes()
        assert cli.main(["vocab", "--target", str(target), "--out", str(out), "--corpus-root", "/no/such/corpus"]) == 2
        assert "holds no token order (no 'tokens_by_frequency')" in capsys.readouterr().err
        assert out.read_bytes() == before
    assert (folder / "config.json").read_bytes() == config
    heads_config = tmp_path / "heads" / "config.json"  # heads keep their order among other keys
    heads_config.parent.mkdir()
    heads_config.write_text(json.dumps({"kind": "eagle3", "tokens_by_frequency": [0, 1], "save_id": "x"}))
    before = heads_config.read_bytes()
    assert cli.main(["vocab", "--target", str(target), "--out", str(heads_config), "--corpus-root", "/no/such"]) == 2
    assert "holds more than a token order (also ['kind', 'save_id'])" in capsys.readouterr().err
    assert heads_config.read_bytes() == before


def test_the_vocab_command_reports_its_draft_vocabs_coverage_and_refuses_windows_past_the_target(
        tiny_models, tiny_corpus, tmp_path, capsys):
    """Only 256 / 1024 / 2048 / 4096 were reported (1.0 each on a 320-token vocabulary), never the size
    drafted among; and --seq-len 300 on a 256-position target counted, where `draftsman train` refuses it."""
    target, _ = tiny_models["llama"]
    base = ["vocab", "--target", str(target), "--out", str(tmp_path / "order.json"), "--corpus-root",
            str(tiny_corpus), "--work-dir", str(tmp_path / "work"), "--threads", "1"]
    assert cli.main(base + ["--tokens", "1024", "--seq-len", "64", "--draft-vocab", "48"]) == 0
    assert "'48': " in capsys.readouterr().out
    coverage = json.loads((tmp_path / "order.json").read_text())["coverage"]
    assert set(coverage) == {"48", "256", "1024", "2048", "4096"} and 0 < coverage["48"] < 1
    (tmp_path / "order.json").unlink()
    for flags, message in ((["--tokens", "1024", "--seq-len", "300"], "--seq-len 300 is longer than the target's 256 "
                                                                      "positions: the count would come from positions"),
                           (["--tokens", "1024", "--seq-len", "64", "--draft-vocab", "1000"],
                            "--draft-vocab 1000 is more than the target's 320 tokens"),
                           (["--draft-vocab", "0"], "--draft-vocab must be >= 1")):
        assert cli.main(base + ["--work-dir", str(tmp_path / "w2")] + flags) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "order.json").exists() and not (tmp_path / "w2").exists()  # refused before tokenizing


def test_vocab_numbers_and_a_missing_corpus_are_named(tiny_models, tmp_path, capsys):
    """--seq-len 0 was a ZeroDivisionError, --threads 0 torch's RuntimeError, --tokens 0 or -5 wrote
    an order counted on one window, and a missing --corpus-root "the train split has 0 tokens"."""
    target, _ = tiny_models["llama"]
    base = ["vocab", "--target", str(target), "--out", str(tmp_path / "order.json")]
    for flags in (["--seq-len", "0"], ["--threads", "0"], ["--tokens", "0"], ["--tokens", "-5"],
                  ["--tokens", "100", "--seq-len", "256"]):
        assert cli.main(base + flags) == 2
        assert "need --threads >= 1 and --tokens >= --seq-len >= 2" in capsys.readouterr().err
    assert cli.main(base + ["--corpus-root", str(tmp_path / "nowhere"), "--work-dir", str(tmp_path / "w")]) == 2
    assert "corpus_root '" in capsys.readouterr().err
    assert not (tmp_path / "order.json").exists()
