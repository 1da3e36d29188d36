"""`layer_skip`: the target drafts for itself with part of its layers. The drafting view computes
what a model built from only those layers computes (an independent Hugging Face model loaded with
the kept layers' weights), every round; greedy output is the target's own generate for Llama,
Qwen2 and GPT-2 at batch 1 and 4, early exit and skipped middle layers, chains and trees; sampled
output follows the target; the target itself is left whole and the drafter owns no weights; bad
options are named."""
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import draftsman
from draftsman.drafters import check_drafter_config

from test_engine_sampling import assert_sampled_marginals_fit
from tiny_models import load_for_reference, model_config

ARCHS = ["llama", "qwen2", "gpt2"]
LAYERS = 4
QUIET = (1, 3)  # layers whose output projections are damped: the rest of the model predicts nearly as they do
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [9]]
NEW_TOKENS = 24
OUTPUT_PROJECTIONS = re.compile(r"\.(o_proj|down_proj|attn\.c_proj|mlp\.c_proj)\.weight$")


@pytest.fixture(scope="module")
def deep_targets(tiny_tokenizer, tmp_path_factory):
    """{arch: folder}: 4-layer tiny targets whose layers 1 and 3 add little to the residual stream,
    so drafts from fewer layers are often accepted and long accepted paths move the draft cache
    (random layers that all matter give drafts that are almost never accepted)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        config = model_config(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id)
        setattr(config, "n_layer" if arch == "gpt2" else "num_hidden_layers", LAYERS)
        if getattr(config, "layer_types", None):  # Qwen2's, one per layer
            config.layer_types = [config.layer_types[0]] * LAYERS
        torch.manual_seed(30 + i)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if OUTPUT_PROJECTIONS.search(name) and int(re.search(r"\.(\d+)\.", name).group(1)) in QUIET:
                    p.mul_(0.05)
        folder = tmp_path_factory.mktemp(f"{arch}-deep")
        model.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        out[arch] = folder
    return out


def model_of_layers(folder, keep: list[int]):
    """A Hugging Face model of the target's config with only the layers `keep`, renumbered 0.., and
    the target's weights: what drafting from those layers must compute, built without the view."""
    whole = load_for_reference(folder)
    config = AutoConfig.from_pretrained(folder)
    count = config.num_hidden_layers
    for key, value in list(vars(config).items()):  # layer_types, Llama 4's no_rope_layers, ...: one per layer
        if isinstance(value, list) and len(value) == count:
            setattr(config, key, [value[i] for i in keep])
    if getattr(config, "moe_layers", None) is not None:  # Llama 4: indices of its mixture-of-experts layers
        config.moe_layers = [keep.index(i) for i in config.moe_layers if i in keep]
    setattr(config, "n_layer" if config.model_type == "gpt2" else "num_hidden_layers", len(keep))
    model = AutoModelForCausalLM.from_config(config).eval()
    prefix = "transformer.h." if config.model_type == "gpt2" else "model.layers."
    weights = {}
    for name, tensor in whole.state_dict().items():
        if not name.startswith(prefix):
            weights[name] = tensor
            continue
        index, rest = name[len(prefix):].split(".", 1)
        if int(index) in keep:
            weights[f"{prefix}{keep.index(int(index))}.{rest}"] = tensor
    model.load_state_dict(weights, strict=True)
    return model


def _decoder(target, drafter):
    return draftsman.load({"target": {"path": str(target), "device": "cpu"}, "drafter": drafter})


def reference_greedy(folder, prompts):
    model = load_for_reference(folder)
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options,keep", [({"exit_layer": 3}, [0, 1, 2]), ({"skip_layers": [1, 3]}, [0, 2])],
                         ids=["exit_layer", "skip_layers"])
def test_drafts_are_what_a_model_of_the_kept_layers_computes(arch, options, keep, deep_targets):
    """Every round, every row of a ragged batch: the greedy chain is what a model built from only
    the kept layers drafts from scratch on the row's context. Keeping other layers, in another
    order, or a cache that kept rejected drafts or lost the emitted tokens, drafts otherwise."""
    dec = _decoder(deep_targets[arch], {"name": "layer_skip", "k": 3, **options})
    checked, out = check_drafts_against(dec, model_of_layers(deep_targets[arch], keep), PROMPTS, 20)
    assert checked > 4 * 5 and out.stats.tau > 1.5  # many rounds, several tokens accepted per round


def check_drafts_against(dec, reference, prompts, new_tokens, **generate):
    """Generate greedily through dec, asserting that every round's chain of every row is the
    reference's greedy continuation of that row's context. Returns (rows checked, output)."""
    propose, checked, k = dec.drafter.propose, [], dec.drafter.k

    def checked_propose(contexts):
        trees = propose(contexts)
        for context, tree in zip(contexts, trees):
            with torch.no_grad():
                chain = reference.generate(torch.tensor([context]), max_new_tokens=k, min_new_tokens=k,
                                           do_sample=False)[0, len(context):]
            assert tree.tokens.tolist() == chain.tolist(), context
            checked.append(len(context))
        return trees

    dec.drafter.propose = checked_propose
    out = dec.generate(input_ids=prompts, max_new_tokens=new_tokens, temperature=0.0, **generate)
    return len(checked), out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_targets_own(arch, deep_targets):
    """Batch 1 and batch 4 (ragged acceptance), early exit and skipped middle layers, chains, a
    confidence-bounded chain and a dynamic tree: all give Hugging Face's greedy generate."""
    expected = reference_greedy(deep_targets[arch], PROMPTS)
    taus = {}
    for name, drafter in {
        "exit": {"exit_layer": 3, "k": 4},
        "exit_early": {"exit_layer": 1, "k": 2},
        "skip": {"skip_layers": [1, 3], "k": 5},
        "skip_confidence": {"skip_layers": [1], "k": 5, "min_confidence": 0.5},
        "tree": {"skip_layers": [3], "k": 4, "top_k": 3, "total_tokens": 8},
    }.items():
        dec = _decoder(deep_targets[arch], {"name": "layer_skip", **drafter})
        one_by_one = [dec.generate(input_ids=[p], max_new_tokens=NEW_TOKENS, temperature=0.0).token_ids[0]
                      for p in PROMPTS]
        assert one_by_one == expected, f"{arch}/{name} batch 1"
        batched = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0)
        assert batched.token_ids == expected, f"{arch}/{name} batch 4"
        taus[name] = batched.stats.tau
    assert taus["skip"] > 2.0 and taus["tree"] > 2.0, taus  # the quiet layers' drafts are mostly accepted


def test_sampled_output_follows_the_target(deep_targets):
    dec = _decoder(deep_targets["llama"], {"name": "layer_skip", "exit_layer": 3, "k": 3})
    assert_sampled_marginals_fit(dec, deep_targets["llama"], [1, 2, 3, 4, 5, 1, 2, 3], 1.0)


def test_the_target_stays_whole_and_the_drafter_owns_no_weights(deep_targets):
    """The view shares the target's modules and replaces only its own lists: after drafting, the
    target still runs all its layers through its own LM head, and the drafter counts none of its
    weights as its own."""
    dec = _decoder(deep_targets["llama"], {"name": "layer_skip", "skip_layers": [1, 2], "k": 3})
    dec.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=0.0)
    whole = load_for_reference(deep_targets["llama"])
    target = dec.target
    assert len(target.model.layers) == LAYERS and target.lm_head.weight.shape[0] == whole.lm_head.weight.shape[0]
    with torch.no_grad():
        x = torch.tensor([PROMPTS[2]])
        torch.testing.assert_close(target(input_ids=x).logits, whole(input_ids=x).logits)
    assert dec.drafter.extra_parameters() == 0
    assert all(any(p is q for q in target.parameters()) for p in dec.drafter.lm.model.parameters())


def test_draft_vocab_reads_the_targets_order_and_owns_only_its_rows(deep_targets, tmp_path):
    """draft_vocab's order defaults to the target's folder (`draftsman vocab` writes it there); the
    copy of those LM head rows is the only weight the drafter owns; output stays the target's."""
    import json
    import shutil

    target = shutil.copytree(deep_targets["llama"], tmp_path / "target")
    (target / "tokens_by_frequency.json").write_text(json.dumps({"tokens_by_frequency": list(range(319, -1, -1))}))
    dec = _decoder(target, {"name": "layer_skip", "exit_layer": 3, "k": 3, "draft_vocab": 100})
    assert dec.drafter.extra_parameters() == 100 * 64  # 100 rows of the 64-wide LM head
    propose, drafted = dec.drafter.propose, set()

    def recording_propose(contexts):
        trees = propose(contexts)
        drafted.update(t for tree in trees for t in tree.tokens.tolist())
        return trees

    dec.drafter.propose = recording_propose
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert out.token_ids == reference_greedy(target, PROMPTS)
    assert drafted and all(t >= 220 for t in drafted)  # only the order's first 100 ids are drafted


@pytest.mark.parametrize("options,message", [
    ({}, "set exactly one of exit_layer .* and skip_layers"),
    ({"exit_layer": 1, "skip_layers": [2]}, "set exactly one of exit_layer"),
    ({"exit_layer": 4}, r"exit_layer=4 must be in 1..3 \(the target has 4 decoder layers"),
    ({"skip_layers": [1, 7]}, r"skip_layers \[7\] are not layers of the target, whose decoder layers are 0..3"),
    ({"skip_layers": [0, 1, 2, 3]}, "skips all 4 decoder layers"),
    ({"exit_layer": 2, "k": 0}, "layer_skip: k must be >= 1, got 0"),
    ({"exit_layer": 2, "min_confidence": 2}, r"layer_skip: min_confidence must be in \[0, 1\], got 2"),
    ({"exit_layer": 2, "vocab_order": "x"}, "vocab_order only applies with draft_vocab"),
    ({"exit_layer": 2, "path": "x"}, r"unknown option\(s\) \['path'\] for drafter 'layer_skip'; valid options"),
    ({"exit_layer": 2, "quantize": "int8"}, r"unknown option\(s\) \['quantize'\]"),
    ({"exit_layer": 2, "k": 1000}, r"^layer_skip: k=1000 leaves no room in the target's context of 256 positions: "
                                   "set drafter.k below it"),
    # (no order file in the target's folder: the count is named, not the missing order)
    ({"exit_layer": 2, "draft_vocab": 10 ** 6}, r"layer_skip: draft_vocab must be between 1 and the vocabulary size "
                                                r"\d+, got 1000000: set it to at most"),
])
def test_bad_options_are_named(deep_targets, options, message):
    with pytest.raises(ValueError, match=message):
        _decoder(deep_targets["llama"], {"name": "layer_skip", **options})


@pytest.mark.parametrize("options,message", [
    ({"exit_layer": 0}, r"exit_layer=0 must be >= 1: the drafts run the target's first exit_layer decoder layers"),
    ({"exit_layer": -1}, r"exit_layer=-1 must be >= 1"),
    ({"skip_layers": [-1]}, r"skip_layers \[-1\] are not layers: decoder layers count from 0"),
    ({"skip_layers": [2, -1, -3, -1]}, r"skip_layers \[-3, -1\] are not layers"),
    ({"skip_layers": []}, "skip_layers is empty, so the drafts would run every layer of the target: skip at least "
                          "one layer, or set exit_layer instead"),
    ({"exit_layer": 2, "draft_vocab": 0}, r"^layer_skip: draft_vocab must be >= 1 .*, got 0: set a positive count"),
    ({"exit_layer": 2, "draft_vocab": -1}, r"^layer_skip: draft_vocab must be >= 1 .*, got -1"),
])
def test_values_that_need_no_target_are_named_before_it_loads(options, message):
    """The check that runs before the target loads (minutes for a large one) names them: no target here."""
    with pytest.raises(ValueError, match=message):
        check_drafter_config({"name": "layer_skip", **options})


# A short one and two longer than the window
SLIDING_PROMPTS = [[1, 2, 3], [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 5, 9, 13, 17],
                   [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def sliding_targets(tiny_tokenizer, tmp_path_factory):
    """{arch: (folder, greedy outputs of SLIDING_PROMPTS)}: the 4-layer sliding-window targets of
    test_sliding_window.py, with a window of 4 (Gemma 2 / 3: sliding and full layers mixed; Mistral: all sliding; Qwen2:
    layers 2 and 3 sliding)."""
    from test_sliding_window import config
    from tiny_models import greedy_targets

    archs = ["gemma2", "gemma3", "mistral", "qwen2"]
    configs = {arch: config(arch, len(tiny_tokenizer), tiny_tokenizer.eos_token_id) for arch in archs}
    for sliding in configs.values():
        sliding.sliding_window = 4  # (a window that short makes Gemma 3's drafts at batch 1 fail without own masks)
    return greedy_targets(tmp_path_factory, tiny_tokenizer, configs, 40, SLIDING_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral", "qwen2"])
@pytest.mark.parametrize("skip", [[0], [0, 1]])
def test_skipping_layer_0_of_a_sliding_window_target_drafts_the_kept_layers(sliding_targets, arch, skip):
    """A row alone (batch 1: its cache has no holes, the case where the masks could be left to
    Hugging Face, which sizes them from the cache's first layers) on a target whose skipped layer 0
    the view never writes: every round's chain is what a model of the kept layers drafts, a tree
    runs, and the output is the target's own."""
    folder, expected = sliding_targets[arch]
    keep = [i for i in range(4) if i not in skip]
    reference = model_of_layers(folder, keep)
    tree = _decoder(folder, {"name": "layer_skip", "skip_layers": skip, "k": 3, "top_k": 2, "total_tokens": 5})
    for prompt, own in zip(SLIDING_PROMPTS, expected):
        chain = _decoder(folder, {"name": "layer_skip", "skip_layers": skip, "k": 3})
        checked, out = check_drafts_against(chain, reference, [prompt], NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert checked > 5 and out.token_ids == [own]
        out = tree.generate(input_ids=[prompt], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)
        assert out.token_ids == [own]
