"""Test 3 of the core issue, on a tiny random Llama in fp32: tree-forward logits equal each
root-to-leaf path run as a chain; the cache after accepting a path (and after rollback, row
selection and compaction) equals a fresh prefill; a batch equals its rows run alone."""
import pytest
import torch

from draftsman.drafters.dynamic_tree import grow_level
from draftsman.verifier.cached_model import CachedLM
from draftsman.verifier.direct_forward import DirectForward
from draftsman.verifier.tree import TreeBlock

from tiny_models import load_for_reference

ATOL = 1e-4
# A tree block: root (slot 0) with children 1, 2, 3; 1 -> 4, 5; 4 -> 6; 3 -> 7.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 4, 3]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_for_reference(tiny_models["llama"][0])


def prefilled(model, prompts):
    lm = CachedLM(model)
    lm.reset(len(prompts))
    lm.forward(TreeBlock.chains(prompts, "cpu"))
    lm.accept([list(range(len(p))) for p in prompts])
    return lm


def chain_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def path_to(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_block(tokens_per_row):
    T = len(TREE_PARENTS)
    tokens = torch.tensor(tokens_per_row)
    return TreeBlock(tokens, torch.tensor([TREE_PARENTS] * len(tokens_per_row)), torch.ones(len(tokens_per_row), T, dtype=torch.bool))


def test_tree_logits_equal_chains(llama):
    prompt = [5, 17, 42, 8, 99, 3]
    lm = prefilled(llama, [prompt])
    tokens = [7, 11, 12, 13, 21, 22, 31, 41]
    logits, _ = lm.forward(tree_block([tokens]))
    for node in range(len(TREE_PARENTS)):
        path = path_to(node, TREE_PARENTS)
        expected = chain_logits(llama, prompt + [tokens[i] for i in path])[-1]
        assert torch.allclose(logits[0, node], expected, atol=ATOL), f"node {node}"


def assert_cache_equals_prefill(model, lm, row, committed):
    fresh = prefilled(model, [committed])
    for layer in range(model.config.num_hidden_layers):
        k, v = lm.committed_kv(row, layer)
        k0, v0 = fresh.committed_kv(0, layer)
        assert k.shape == k0.shape, f"row {row} layer {layer}: {tuple(k.shape)} vs {tuple(k0.shape)}"
        assert torch.allclose(k, k0, atol=ATOL) and torch.allclose(v, v0, atol=ATOL)


def test_accepted_path_cache_equals_fresh_prefill_in_a_ragged_batch(llama):
    prompts = [[5, 17, 42, 8, 99, 3], [9, 9], [1, 2, 3, 4]]
    rows_tokens = [[7, 11, 12, 13, 21, 22, 31, 41], [4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    keep = [[0, 1, 4, 6], [0], [0, 3, 7]]  # root-first accepted paths, different lengths
    lm = prefilled(llama, prompts)
    lm.forward(tree_block(rows_tokens))
    lm.accept(keep)
    committed = [p + [t[i] for i in k] for p, t, k in zip(prompts, rows_tokens, keep)]
    for row in range(3):
        assert_cache_equals_prefill(llama, lm, row, committed[row])
    # A second round on top of the holes the first one left behind.
    logits, _ = lm.forward(tree_block(rows_tokens))
    for row in range(3):
        expected = chain_logits(llama, committed[row] + [rows_tokens[row][0]])[-1]
        assert torch.allclose(logits[row, 0], expected, atol=ATOL)
    lm.accept([[0, 2], [0, 1, 5], [0]])
    committed = [c + [t[i] for i in k] for c, t, k in zip(committed, rows_tokens, [[0, 2], [0, 1, 5], [0]])]
    for row in range(3):
        assert_cache_equals_prefill(llama, lm, row, committed[row])
    # Rollback and dropping a row keep the rest intact.
    lm.rollback(torch.tensor([len(committed[0]) - 2, len(committed[1]), len(committed[2]) - 1]))
    lm.select_rows([0, 2])
    assert_cache_equals_prefill(llama, lm, 0, committed[0][:-2])
    assert_cache_equals_prefill(llama, lm, 1, committed[2][:-1])


def test_compaction_squeezes_holes_and_keeps_the_cache(llama):
    prompts = [[3] * 40, [4, 5]]
    lm = prefilled(llama, prompts)  # row 1 is 38 slots shorter than row 0: those slots are holes
    assert lm.num_slots == 40
    committed = [list(p) for p in prompts]
    for step in range(30):  # row 0 keeps 1 token a round, row 1 keeps 3: holes pile up in row 0
        block = tree_block([[step % 50 + 1] * 8, [step % 40 + 2] * 8])
        lm.forward(block)
        lm.accept([[0], [0, 1, 4]])
        committed[0] += [step % 50 + 1]
        committed[1] += [step % 40 + 2] * 3
    # Row 0 left two holes a round (60 in all): compaction must have squeezed them out.
    longest = max(len(c) for c in committed)
    assert lm.num_slots - longest <= max(16, lm.num_slots // 4)
    for row in range(2):
        assert_cache_equals_prefill(llama, lm, row, committed[row])


def test_batch_equals_rows_alone(llama):
    prompts = [[5, 17, 42, 8, 99, 3], [9, 9], [1, 2, 3, 4, 6, 7, 8, 9, 10]]
    rows_tokens = [[7, 11, 12, 13, 21, 22, 31, 41], [4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    together, _ = prefilled(llama, prompts).forward(tree_block(rows_tokens))
    for row in range(3):
        alone, _ = prefilled(llama, [prompts[row]]).forward(tree_block([rows_tokens[row]]))
        assert torch.allclose(together[row], alone[0], atol=ATOL)


def test_padded_rows_make_no_nan(llama):
    lm = prefilled(llama, [[1, 2, 3], [4]])
    block = TreeBlock(torch.tensor([[5, 6, 7], [8, 0, 0]]), torch.tensor([[-1, 0, 1], [-1, -1, -1]]),
                      torch.tensor([[True, True, True], [True, False, False]]))
    logits, _ = lm.forward(block)
    assert torch.isfinite(logits).all()


def test_chain_fast_path_matches_the_general_walk():
    from draftsman.verifier.tree import ancestors_and_depth
    block = TreeBlock.chains([[4, 5, 6], [7], []], "cpu")
    anc, depth = ancestors_and_depth(block.parents)
    assert torch.equal(block.ancestors, anc) and torch.equal(block.depth, depth)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_logits_at_one_position_per_row(tiny_models, arch):
    """A prefill asks for one row of logits per row (the LM head over a whole prompt is waste)."""
    model = load_for_reference(tiny_models[arch][0])
    prompts = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5]]
    full = CachedLM(model)
    full.reset(3)
    all_logits, _ = full.forward(TreeBlock.chains(prompts, "cpu"))
    some = CachedLM(model)
    some.reset(3)
    last = torch.tensor([len(p) - 1 for p in prompts])
    picked, _ = some.forward(TreeBlock.chains(prompts, "cpu"), logits_at=last)
    assert picked.shape == (3, all_logits.shape[-1])
    torch.testing.assert_close(picked, all_logits[torch.arange(3), last], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch,direct", [("llama", True), ("llama", False), ("qwen2", True), ("gpt2", False)])
def test_logits_at_several_positions_per_row(tiny_models, arch, direct):
    """A parallel draft model reads its last k positions per row: (B, k) indices give (B, k, V),
    the rows' own positions (ragged prompts), through the direct forward and Hugging Face's."""
    model = load_for_reference(tiny_models[arch][0])
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [3, 4, 5, 6]]
    full = CachedLM(model)
    full.reset(3)
    all_logits, _ = full.forward(TreeBlock.chains(prompts, "cpu"))
    some = CachedLM(model, direct=direct)
    assert (some.direct is not None) == direct
    some.reset(3)
    at = torch.tensor([[len(p) - 3 + j for j in range(3)] for p in prompts])
    picked, _ = some.forward(TreeBlock.chains(prompts, "cpu"), logits_at=at)
    assert picked.shape == (3, 3, all_logits.shape[-1])
    torch.testing.assert_close(picked, all_logits[torch.arange(3)[:, None], at], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_cache_goes_by_the_name_the_installed_model_takes(tiny_models, arch):
    """transformers 5.x renamed `past_key_values` to `cache`; an older release silently ignores
    `cache=` and decodes without a cache, so the name must be one the forward declares."""
    import inspect

    from draftsman.verifier.hf_compat import cache_kwarg
    model = load_for_reference(tiny_models[arch][0])
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters


class _PositionsDropped(DirectForward):
    """Broken on purpose: every token at position 0, so the rotary table never moves a key."""

    def __call__(self, cache, mask, position_ids, **inputs):
        return super().__call__(cache, mask, torch.zeros_like(position_ids), **inputs)


def _direct_and_wrapped_outputs(model, broken: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same calls through a direct and a wrapped CachedLM, as a drafter makes them: a ragged
    prefill read at one position per row, a tree with the last hidden state, a path accepted, a
    level grown from inputs_embeds with its ancestors' slots visible, then a rollback and a chain.
    Returns (direct, wrapped) pairs of logits and of last hidden states."""
    direct, wrapped = CachedLM(model, direct=True), CachedLM(model)
    assert direct.direct is not None and wrapped.direct is None
    if broken:
        direct.direct = _PositionsDropped(model, direct.cache_kwarg)
    prompts = [[5, 6, 7, 8, 9, 10], [1, 2], [3, 4, 5]]
    tree = tree_block([[11, 12, 13, 14, 15, 16, 17, 18]] * 3)
    embed = model.get_input_embeddings()
    pairs = []
    for lm in (direct, wrapped):
        lm.reset(3)
        out = [lm.forward(TreeBlock.chains(prompts, "cpu"), logits_at=torch.tensor([5, 1, 2]))[0]]
        lm.accept([list(range(len(p))) for p in prompts])
        logits, hidden = lm.forward(tree, (-1,))
        out += [logits, hidden[-1]]
        lm.accept([[0, 1, 4, 6], [0, 3, 7], [0]])
        level = torch.tensor([[20, 21], [22, 23], [24, 25]])
        logits, hidden = lm.forward(TreeBlock.chains([[19]] * 3, "cpu"), (-1,))
        visible = torch.zeros(3, 2, lm.num_slots, dtype=torch.bool)
        visible[:, :, -1] = True  # both nodes are children of the uncommitted [19]
        grown = grow_level(lm, level, 2, visible, (-1,), embed(level))
        out += [logits, hidden[-1], grown[0], grown[1][-1]]
        lm.rollback(lm.lengths.clone())
        out.append(lm.forward(TreeBlock.chains([[7, 8], [9], [10, 11, 12]], "cpu"))[0])
        pairs.append(out)
    return list(zip(*pairs))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_direct_forward_gives_what_the_model_gives(tiny_models, arch):
    """Drafters call the layers without Hugging Face's wrappers (verifier/direct_forward.py): the
    logits and last states must be the model's own, through holes, trees and grown levels."""
    model = load_for_reference(tiny_models[arch][0])
    for got, expected in _direct_and_wrapped_outputs(model):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_direct_forward_comparison_catches_a_path_that_drops_positions(tiny_models):
    model = load_for_reference(tiny_models["llama"][0])
    worst = max((got - expected).abs().max().item()
                for got, expected in _direct_and_wrapped_outputs(model, broken=True))
    assert worst > 1e-2


def test_a_model_of_another_family_runs_through_its_own_forward(tiny_models):
    model = load_for_reference(tiny_models["gpt2"][0])
    lm = CachedLM(model, direct=True)
    assert lm.direct is None  # GPT-2 has no rotary table: its forward is not the order direct calls
    lm.reset(1)
    logits, hidden = lm.forward(TreeBlock.chains([[5, 6, 7]], "cpu"), (-1,))
    assert logits.shape[:2] == (1, 3) and hidden[-1].shape[:2] == (1, 3)
