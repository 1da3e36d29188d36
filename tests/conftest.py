import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

# Tiny models gain nothing from a second thread, and on a busy 2-core machine two OpenMP threads
# wait on each other (a 0.6 s test took 17 s). One thread keeps the suite fast and steady.
torch.set_num_threads(1)
hf_logging.disable_progress_bar()

from tiny_models import CORPUS, build_chat_tokenizer, build_model_folder, build_tokenizer, load_for_reference


@pytest.fixture(autouse=True)
def one_torch_thread():
    """A test that leaves torch on more threads fails here, by name: every later test of its worker
    would contend for the cores with the other worker's, at 4 to 5 times its time (the vocab
    command's 2 threads, left behind, once cost the suite about 90 s). training/threads.py puts the
    caller's count back."""
    yield
    left = torch.get_num_threads()
    if left != 1:
        torch.set_num_threads(1)
        pytest.fail(f"the test left torch with {left} threads (a trainer's `threads` not put back?)")


def _loading_hooks() -> dict:
    """What Hugging Face's loading swaps for no-ops while a model loads and puts back after
    (transformers/initialization.py: no_init_weights, no_tie_weights)."""
    from transformers import PreTrainedModel
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    hooks = {("PreTrainedModel", name): getattr(PreTrainedModel, name) for name in ("tie_weights", "init_weights")}
    hooks.update({("torch.nn.init", name): getattr(torch.nn.init, name) for name in TORCH_INIT_FUNCTIONS})
    return hooks


_LOADING_HOOKS = _loading_hooks()


@pytest.fixture(autouse=True)
def loading_hooks_put_back():
    """Two loads at once in one process (threads) can leave those no-ops in place for good: every
    later load of a tied model in that worker then left its LM head empty (on the meta device) and
    a dozen unrelated tests failed. The test that did it fails here, by name, and the originals go back."""
    yield
    left = [".".join(key) for key, hook in _loading_hooks().items() if hook is not _LOADING_HOOKS[key]]
    if left:
        from transformers import PreTrainedModel

        for (owner, name), hook in _LOADING_HOOKS.items():
            setattr(PreTrainedModel if owner == "PreTrainedModel" else torch.nn.init, name, hook)
        pytest.fail(f"the test left Hugging Face's loading no-ops in place of {left} (models loaded in two threads "
                    "at once?)")


@pytest.fixture(autouse=True)
def forget_test_drafters():
    """Drafters registered by a test leave the registry afterwards (other tests list it)."""
    from draftsman.drafters.registry import _REGISTRY

    before = set(_REGISTRY)
    yield
    for name in set(_REGISTRY) - before:
        del _REGISTRY[name]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer):
    """{arch: (target_dir, draft_dir)} for llama, qwen2 and gpt2, sharing one tokenizer."""
    out = {}
    for i, arch in enumerate(["llama", "qwen2", "gpt2"]):
        root = tmp_path_factory.mktemp(arch)
        target = build_model_folder(root / "target", arch, seed=10 + i, tokenizer=tiny_tokenizer)
        draft = build_model_folder(root / "draft", arch, seed=20 + i, size="draft", tokenizer=tiny_tokenizer)
        out[arch] = (target, draft)
    return out


@pytest.fixture(scope="session")
def fresh_heads(tiny_models, tmp_path_factory):
    """Freshly initialised heads for the tiny Llama target, one folder each: eagle, mtp, eagle3,
    medusa, mlp_speculator (for tests of drafting mechanics, which need no trained heads)."""
    from draftsman.heads.feature_head import FeatureHead
    from draftsman.heads.medusa import MedusaHeads
    from draftsman.heads.mlp_speculator import MLPSpeculator

    out = tmp_path_factory.mktemp("fresh-heads")
    target = load_for_reference(tiny_models["llama"][0])
    for kind in ("eagle", "mtp", "eagle3"):
        FeatureHead.for_target(target, kind).save(out / kind, target, dtype=torch.float32)
    MedusaHeads.for_target(target, num_heads=4).save(out / "medusa", target, dtype=torch.float32)
    MLPSpeculator.for_target(target, n_predict=3, inner_dim=32, tie_weights=True).save(
        out / "mlp_speculator", target, dtype=torch.float32)
    return out


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A folder of small .py files, some of them in the held-out split, for head training."""
    from draftsman.training.corpus import is_heldout

    root = tmp_path_factory.mktemp("corpus")
    i = 0
    while i < 30 or not any(is_heldout(f"m{j}.py") for j in range(i)):
        (root / f"m{i}.py").write_text("".join(CORPUS[(i + k) % len(CORPUS)] for k in range(6)))
        i += 1
    return root


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    """A tiny Qwen2 instruct-style target: its generation config ends rows at EOS and at <|im_end|>."""
    folder = tmp_path_factory.mktemp("chat-target")
    tok = build_chat_tokenizer(folder)
    build_model_folder(folder, "qwen2", seed=31, tokenizer=tok)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    # As loaded, not as built: beside a Qwen2 config.json it loads as Qwen2's tokenizer class,
    # which splits digits one by one.
    return folder, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def served(chat_target):
    """(decoder, base URL): `draftsman serve` on the tiny chat target with an n-gram drafter, in a
    thread, one per test module (tests/serving.py)."""
    from serving import ngram_decoder, running

    decoder = ngram_decoder(chat_target[0])
    with running(decoder) as (_, base):
        yield decoder, base


@pytest.fixture(scope="session")
def plain(tiny_models) -> list[list[int]]:
    """The tiny Llama target's greedy output (16 tokens) for test_row_sampling's PROMPTS, which
    the per-row settings' tests make their settings from (so that each one changes its row)."""
    import draftsman
    from row_settings import NEW
    from test_row_sampling import PROMPTS

    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    return decoder.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0).token_ids
