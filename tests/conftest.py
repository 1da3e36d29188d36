import pytest

from tiny_models import build_model_folder, build_tokenizer


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
