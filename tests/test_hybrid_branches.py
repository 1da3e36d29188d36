"""A draft tree on a target with recurrent layers, read as its branches (verifier/branches.py):
each row's cache copied once per root-to-leaf branch, each copy reading its branch as a chain,
and each row going on with the copy whose branch holds its accepted path. The logits at every
node and the state after the kept path equal a fresh forward's; greedy output equals Hugging
Face's own with the right tokens on a later branch (accepted there); sampled trees, children
drawn without replacement, keep the target's distribution (chi-square)."""
import pytest
import torch

import draftsman
from draftsman.drafters import DETERMINISTIC, IID, WITHOUT_REPLACEMENT, DraftTree, register
from draftsman.verifier import hf_compat
from draftsman.verifier.branches import Branches
from draftsman.verifier.cached_model import CachedLM
from draftsman.verifier.prefill import Prefill
from draftsman.verifier.tree import TreeBlock

from test_hybrid_targets import NEW, PROMPTS, config
from tiny_models import greedy_targets, load_for_reference
from toy_drafters import ToyDrafter

ARCHS = ["qwen3_5", "nemotron_h", "jamba", "mamba"]
KNOWN: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + the target's greedy output


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_tokenizer):
    if not hf_compat.RECORDS_RECURRENT_STATES:
        pytest.skip("this transformers release does not record recurrent states (5.25 does)")
    eos = tiny_tokenizer.eos_token_id
    configs = {arch: config(arch, len(tiny_tokenizer), eos) for arch in ARCHS}
    return greedy_targets(tmp_path_factory, tiny_tokenizer, configs, 80, PROMPTS, NEW)


def tree(tokens, parents, kinds=None, probs=None):
    kinds = [DETERMINISTIC] * len(tokens) if kinds is None else kinds
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(kinds), probs)


def test_first_branches_keep_first_children_and_fork_shallowest_first():
    #            root
    #        0         1        4
    #      2   3       5
    #      6
    t = tree([10, 11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, -1, 1, 2])
    assert t.first_branches(1).tokens.tolist() == [10, 12, 16]  # first children down to a leaf
    assert t.first_chain().tokens.tolist() == [10, 12, 16]
    two = t.first_branches(2)  # the root forks before node 0 does
    assert two.tokens.tolist() == [10, 11, 12, 15, 16] and two.parents.tolist() == [-1, -1, 0, 1, 2]
    assert t.first_branches(3).tokens.tolist() == [10, 11, 12, 14, 15, 16]  # the root's third child
    assert t.first_branches(4) is t and t.first_branches(9) is t  # all four leaves
    chain = DraftTree.chain([1, 2, 3])
    assert chain.first_branches(3) is chain
    # Kinds and distributions go with their nodes.
    probs = torch.softmax(torch.randn(7, 20), -1)
    sampled = tree([10, 11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, -1, 1, 2], [IID] * 7, probs)
    assert torch.equal(sampled.first_branches(2).draft_probs, probs[[0, 1, 2, 5, 6]])


def test_first_branches_keep_a_prefix_of_every_nodes_children():
    """What keeps them exact: a kept child's earlier siblings are all kept (random trees)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 25, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        t = tree(list(range(n)), parents)
        leaves = n - len({p for p in parents if p >= 0})
        for count in (1, 2, 3, 5):
            kept = t.first_branches(count)
            ids = kept.tokens.tolist()  # token i is node i of t
            assert len(ids) - len({p for p in kept.parent_list() if p >= 0}) == min(count, leaves)  # its leaves
            for node in ids:
                siblings = [s for s in range(node) if parents[s] == parents[node]]
                assert set(siblings) <= set(ids), (parents, count, ids)
                assert parents[node] < 0 or parents[node] in ids


def test_a_blocks_branches_and_the_rows_they_return_to():
    # row 0: root 0 -> 1 -> 3, root -> 2 (two branches); row 1: root 0 -> 1, padding after
    block = TreeBlock(torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]]),
                      torch.tensor([[True] * 4, [True, True, False, False]]))
    b = Branches.of(block)
    assert b.owners == [0, 0, 1] and b.nodes == [[0, 1, 3], [0, 2], [0, 1]]
    assert b.block.tokens.tolist() == [[5, 6, 8], [5, 7, 0], [9, 10, 0]]
    per_branch = torch.arange(9).reshape(3, 3)  # branch row r, depth d -> 3 r + d
    assert b.to_tree(per_branch).tolist() == [[0, 1, 4, 2], [6, 7, 6, 6]]  # padding reads its row's root
    keep, chosen = b.kept([[0, 2], [0, 1]])
    assert chosen == [1, 2] and keep == [[0], [0, 1], [0, 1]]
    keep, chosen = b.kept([[0], [0]])
    assert chosen == [0, 2] and keep == [[0], [0], [0]]
    with pytest.raises(RuntimeError, match="no branch of its tree holds"):
        b.kept([[0, 3], [0]])  # node 3 hangs below node 1


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba", "mamba"])
def test_the_cache_reads_a_tree_as_its_branches(targets, arch):
    """Every node's logits and last hidden state, then the next logits after each row's kept path
    (on a later branch, the first, or the root alone), equal a fresh forward over the row's text."""
    model = load_for_reference(targets[arch][0])
    lm = CachedLM(model)
    rows = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    prefill = Prefill(lm, rows, (), "cpu")
    prefill.step()
    prefill.finish()
    rows = [r[:-1] for r in rows]  # the prefill cached all but the last token: the roots
    #   row 0: root -> 20 -> 21, root -> 22 -> 23 -> 24, root -> 25     row 1: a chain   row 2: root -> 30 -> {31, 32}
    block = TreeBlock(torch.tensor([[9, 20, 21, 22, 23, 24, 25], [11, 26, 27, 0, 0, 0, 0], [15, 30, 31, 32, 0, 0, 0]]),
                      torch.tensor([[-1, 0, 1, 0, 3, 4, 0], [-1, 0, 1, -1, -1, -1, -1], [-1, 0, 1, 1, -1, -1, -1]]),
                      torch.tensor([[True] * 7, [True] * 3 + [False] * 4, [True] * 4 + [False] * 3]))
    logits, hidden = lm.forward(block, (-1,))
    assert logits.shape == (3, 7, model.config.vocab_size) and hidden[-1].shape[:2] == (3, 7)
    tokens, valid = block.tokens.tolist(), block.valid.tolist()
    for b in range(3):
        for n in range(7):
            if not valid[b][n]:
                continue
            path, p = [n], block.parents[b, n].item()
            while p >= 0:
                path, p = [p] + path, block.parents[b, p].item()
            out = model(torch.tensor([rows[b] + [tokens[b][i] for i in path]]), output_hidden_states=True)
            torch.testing.assert_close(logits[b, n], out.logits[0, -1], rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(hidden[-1][b, n], out.hidden_states[-1][0, -1], rtol=2e-3, atol=2e-3)
    keep = [[0, 3, 4], [0, 1, 2], [0, 1, 3]]  # row 0 on its second branch, row 2 on its second leaf
    lm.accept(keep)
    assert lm.lengths.tolist() == [len(r) + len(k) for r, k in zip(rows, keep)]
    rows = [r + [tokens[b][i] for i in k] for b, (r, k) in enumerate(zip(rows, keep))]
    nxt = [[40], [41], [42]]
    logits, _ = lm.forward(TreeBlock.chains(nxt, "cpu"))
    lm.accept([[0]] * 3)
    for b, row in enumerate(rows):
        torch.testing.assert_close(logits[b, 0], model(torch.tensor([row + nxt[b]])).logits[0, -1],
                                   rtol=2e-3, atol=2e-3)
    assert lm.num_slots <= max(len(r) + 1 for r in rows)  # the branch copies are gone


class RightOnALaterBranch(ToyDrafter):
    """The target's greedy continuation as the root's second branch, behind a first branch whose
    first token is wrong: a target that read only the first chain would accept nothing."""
    name = "right_on_a_later_branch"

    def propose(self, contexts):
        trees = []
        for context in contexts:
            full = next((seq for seq in KNOWN.values() if seq[: len(context)] == context), None)
            right = full[len(context): len(context) + self.k] if full else []
            if not right:
                trees.append(DraftTree.empty())
                continue
            wrong = [(t + 1) % self.vocab for t in right]
            n = len(right)
            trees.append(tree(wrong + right, [-1, *range(n - 1), -1, *range(n, 2 * n - 1)]))
        return trees


@pytest.fixture
def later_branch():
    register(RightOnALaterBranch)  # conftest's forget_test_drafters takes it out after


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_with_the_right_drafts_on_a_later_branch(targets, arch, later_branch):
    folder, expected = targets[arch]
    KNOWN.clear()
    KNOWN.update({tuple(p): p + e for p, e in zip(PROMPTS, expected)})
    k = 4
    for branches in (4, 2):  # shared by the two rows: 2 branches each, then 1
        dec = draftsman.load({"target": {"path": str(folder), "recurrent_branches": branches},
                              "drafter": {"name": "right_on_a_later_branch", "k": k}})
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, branches
        accepted = [n for row in out.stats.accepted_per_round for n in row]
        if branches == 2:  # only the wrong first chain was read; a row alone reads both branches
            assert set(accepted) == {0}
            alone = dec.generate(input_ids=PROMPTS[:1], max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
            assert alone.token_ids == expected[:1] and max(alone.stats.accepted_per_round[0]) == k
        else:  # every draft of the right branch, in all rounds but a row's last (cut to its limit)
            assert max(accepted) == k, accepted
            assert all(len(rounds) <= -(-NEW // (k + 1)) + 1 for rounds in out.stats.accepted_per_round), accepted


class SampledTree(ToyDrafter):
    """At T > 0: the root's children are 3 draws without replacement from q, the target's own
    next-token distribution at temperature 1, and each has one child drawn from its q. A target
    that kept a later child without an earlier one would bias what it emits."""
    name = "sampled_tree_for_a_hybrid"

    def __init__(self, options, target):
        super().__init__(options, target)
        self.model, self.q_of = target.model, {}
        self.g = torch.Generator().manual_seed(3)

    def q(self, context):
        if tuple(context) not in self.q_of:
            with torch.no_grad():
                logits = self.model(torch.tensor([context])).logits[0, -1].double()
            self.q_of[tuple(context)] = torch.softmax(logits, -1).float()
        return self.q_of[tuple(context)]

    def propose(self, contexts):
        trees = []
        for context in contexts:
            q0 = self.q(context)
            first = torch.multinomial(q0, 3, replacement=False, generator=self.g).tolist()
            seconds, probs = [], [q0] * 3
            for t in first:
                q1 = self.q(context + [t])
                seconds.append(int(torch.multinomial(q1, 1, generator=self.g)))
                probs.append(q1)
            trees.append(tree(first + seconds, [-1, -1, -1, 0, 1, 2], [WITHOUT_REPLACEMENT] * 3 + [IID] * 3,
                              torch.stack(probs)))
        return trees


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_sampled_trees_keep_a_hybrid_targets_distribution(targets, arch):
    """T=0.7: 6000 rows, each a tree of 3 children drawn without replacement, of which the target
    reads 2 (first and second tokens, chi-square against the exact marginals)."""
    from test_engine_sampling import ALPHA, ROWS, exact_marginals, fit_pvalue

    from draftsman.verifier.sampling import SamplingParams

    register(SampledTree)
    folder, _ = targets[arch]
    dec = draftsman.load({"target": {"path": str(folder), "recurrent_branches": 2 * ROWS},  # 2 a row
                          "drafter": {"name": "sampled_tree_for_a_hybrid", "k": 2}})
    prompt = PROMPTS[1]
    out = dec.generate(input_ids=[prompt] * ROWS, max_new_tokens=2, temperature=0.7, seed=5)
    assert out.stats.tau > 1.5  # drafts were accepted, on first and on later children
    p1, p2 = exact_marginals(load_for_reference(folder), prompt, SamplingParams(0.7), dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(first, p1) > ALPHA and fit_pvalue(second, p2) > ALPHA


def test_recurrent_branches_must_be_positive(targets):
    with pytest.raises(ValueError, match=r"target.recurrent_branches must be 1 or more"):
        draftsman.load({"target": {"path": str(targets["mamba"][0]), "recurrent_branches": 0}})
