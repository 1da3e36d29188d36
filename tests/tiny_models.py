"""Tiny random models of real architectures, saved to and loaded from folders like real ones."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, AutoModelForCausalLM

EOT = "<|endoftext|>"
CORPUS = [
    "def parse(text):\n    return [line.split() for line in text.splitlines()]\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 4


def build_tokenizer(folder: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, pad_token=EOT)
    fast.save_pretrained(folder)
    return fast


# ChatML, as Qwen2's instruct models write it, behind a BOS token as Llama 3's templates add one;
# enable_thinking=false writes an empty thought, as Qwen3's template does.
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
          "{% endif %}")


def build_chat_tokenizer(folder: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A tokenizer like an instruct model's: BOS added to every encoding, turn-marker special
    tokens and a ChatML chat template."""
    specials = [EOT, "<s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token="<s>", pad_token=EOT,
                                   additional_special_tokens=specials[2:])
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def chatml_ids(tok, conversation: list[dict], open_turn: bool = True) -> list[int]:
    """CHATML written out by hand: one BOS, each turn's markers as single tokens, then (open_turn)
    the assistant's turn opened."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = [tok.bos_token_id]
    for m in conversation:
        ids += [start, *text(f"{m['role']}\n{m['content']}"), end, *text("\n")]
    return ids + [start, *text("assistant\n")] if open_turn else ids


def model_config(arch: str, vocab_size: int, eos_id: int, size: str = "target"):
    hidden, layers = (64, 2) if size == "target" else (32, 1)
    common = dict(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.2, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.2, use_sliding_window=False, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
                          initializer_range=0.2, **common)
    raise ValueError(arch)


def build_model_folder(folder: Path, arch: str, seed: int, size: str = "target", vocab_size: int | None = None,
                       tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A random model of `arch`, saved with the given tokenizer (or a fresh one)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(folder)
    tok.save_pretrained(folder)
    cfg = model_config(arch, vocab_size or len(tok), tok.eos_token_id, size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return folder


def target_device(drafter: dict | None) -> str:
    """Where a test puts the target for this drafter config: "auto" (CUDA on a GPU machine), but
    the CPU for an int8 drafter, which runs on CPU only and refuses a CUDA target by design."""
    return "cpu" if drafter and drafter.get("quantize") == "int8" else "auto"


def greedy_targets(tmp_path_factory, tokenizer, configs: dict, seed: int, prompts: list[list[int]],
                   new_tokens: int) -> dict[str, tuple[Path, list[list[int]]]]:
    """{name: (folder, greedy outputs)}: each config as a model folder with random weights (seeded
    seed, seed + 1, ...) and the tokenizer beside, and Hugging Face's own greedy generate of
    new_tokens after each prompt, the reference the tests compare with."""
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        folder = tmp_path_factory.mktemp(name)
        tokenizer.save_pretrained(folder)
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        reference = load_for_reference(folder)
        out[name] = (folder, [reference.generate(torch.tensor([p]), max_new_tokens=new_tokens,
                                                 min_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
                              for p in prompts])
    return out


def load_for_reference(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_where_the_cli_counts(folder: Path):
    """(model, autocast) on the device `draftsman vocab` counts on (CUDA where there is one), in its
    bf16 autocast: picks near a tie can differ between devices, and the order with them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_for_reference(folder).to(device), lambda: torch.autocast(device, dtype=torch.bfloat16)


def perturbed_copy(source: Path, folder: Path, noise: float, seed: int = 0) -> Path:
    """The source model with Gaussian noise on every weight: a drafter that agrees with the target
    often but not always (random tiny drafters almost never agree, which tests nothing)."""
    model = load_for_reference(source)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def permuted_vocab_copy(source: Path, folder: Path, seed: int = 0) -> Path:
    """The model in `source` under a tokenizer whose ordinary tokens have other ids (special
    tokens keep theirs), its embedding and LM head rows moved with them: the same model, the same
    text, another vocabulary. Saved to `folder`."""
    import json
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    spec = json.loads((Path(source) / "tokenizer.json").read_text())
    special = {t["id"] for t in spec.get("added_tokens", [])}
    vocab = spec["model"]["vocab"]
    ordinary = sorted(i for i in vocab.values() if i not in special)
    shuffled = torch.tensor(ordinary)[torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(seed))]
    new_id = dict(zip(ordinary, shuffled.tolist()))
    spec["model"]["vocab"] = {token: new_id.get(i, i) for token, i in vocab.items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, folder / name)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    old_of_new = torch.arange(model.get_input_embeddings().weight.shape[0])
    for old, new in new_id.items():
        old_of_new[new] = old
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight[old_of_new])
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight[old_of_new])
    model.save_pretrained(folder)
    return folder
