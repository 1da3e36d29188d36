"""What structured output's masks cost, packed (verifier/token_masks.py: a byte table and
torch.minimum, in place) against the way before session 47 (each mask unpacked into one bool per
token, then masked_fill on the rows gathered and scattered back), kept here as the reference.

1. The masking alone: ms per block of 1, 6, 21 and 60 masked nodes at 8192 and 151,936 tokens
   (random masks, float32 logits), and whether the logits are equal. With `masking cuda` the
   logits are on the GPU (the masks come from the CPU, as llguidance fills them there).
2. Generation at a 152k vocabulary: a byte-level BPE of 151,936 tokens trained here on the Python
   standard library (tokenizers; about a minute) and a 2-layer Qwen2 with random weights, under a
   JSON-object grammar and a JSON schema, with `none` and `draft_model` (the model drafting for
   itself, k 4: masks on the drafter's side too). 4 prompts, 48 new tokens, T=0, batch 1; the two
   ways interleaved prompt by prompt in one process, equal outputs asserted.
3. The bundled target (8192 tokens) under the same grammars with `none`, `ngram` and EAGLE-3 (the
   int8 tree), as 2.

The reference leaves out one cost of the old way, the end tokens OR-ed into every mask as bools,
so the gain is understated a little.

    python scripts/grammar_mask_cost.py            # all three
    python scripts/grammar_mask_cost.py masking    # the first only
    python scripts/grammar_mask_cost.py masking cuda
"""
import glob
import statistics
import sys
import tempfile
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import draftsman
from draftsman.bench.config import INT8_EAGLE3_TREE
from draftsman.verifier import token_masks

BITS = torch.arange(32, dtype=torch.int32)
PACKED = token_masks.TokenMasks.apply_
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "args": {"type": "array",
          "items": {"type": "string"}}, "doc": {"type": "string"}}, "required": ["name", "args", "doc"]}
GRAMMARS = {"json-object": {"json_object": True}, "json-schema": {"json": SCHEMA, "disable_any_whitespace": True}}
PROMPTS = ["Describe the function as JSON:\ndef parse(argv):\n", "The call, as JSON:\nopen(path, 'rb')\n",
           "JSON for the class:\nclass Stack:\n", "As a JSON object:\nimport os\n"]


def unpacked_apply_(self, rows: torch.Tensor, at: list[int], columns: torch.Tensor | None = None) -> None:
    """The way before: every mask unpacked into bools on the CPU, moved, masked_fill."""
    allowed = ((self.bitmask[:, :, None] >> BITS) & 1).bool().flatten(1)
    if columns is not None:
        allowed = allowed[:, columns.cpu()]
    width = rows.shape[-1]
    allowed = allowed[:, :width]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    index = torch.tensor(at, device=rows.device)
    rows[index] = rows[index].masked_fill(~allowed.to(rows.device), -torch.inf)


WAYS = {"unpacked": unpacked_apply_, "packed": PACKED}


def use(way: str) -> None:
    token_masks.TokenMasks.apply_ = WAYS[way]


def masking_section(device: str = "cpu") -> None:
    where = f"{torch.get_num_threads()} CPU threads" if device == "cpu" else torch.cuda.get_device_name()
    print(f"1. Masking a block, ms (float32 logits, {where})")
    print("| vocabulary | nodes | unpacked | packed | ratio | equal |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for vocab in (8192, 151936):
        for nodes in (1, 6, 21, 60):
            masks = token_masks.TokenMasks(torch.randint(-2 ** 31, 2 ** 31 - 1, (nodes, (vocab + 31) // 32),
                                                         dtype=torch.int32, generator=g))
            logits = torch.randn(2, nodes // 2 + 2, vocab, generator=g).to(device)
            at = [b * logits.shape[1] + j for b in range(2) for j in range(1, 1 + (nodes + 1 - b) // 2)][:nodes]
            ms, outs = {}, {}
            for _ in range(2):  # interleaved
                for way, apply_ in WAYS.items():
                    out = logits.clone()
                    apply_(masks, out.view(-1, vocab), at)  # warm
                    outs[way] = out
                    synchronize(device)
                    start = time.perf_counter()
                    for _ in range(10):
                        copy = logits.clone()
                        apply_(masks, copy.view(-1, vocab), at)
                    synchronize(device)
                    ms.setdefault(way, []).append((time.perf_counter() - start) / 10 * 1000)
            synchronize(device)
            clone = time.perf_counter()
            for _ in range(10):
                logits.clone()
            synchronize(device)
            clone = (time.perf_counter() - clone) / 10 * 1000
            before, after = (min(ms[way]) - clone for way in WAYS)
            print(f"| {vocab} | {nodes} | {before:.2f} | {after:.2f} | {before / max(after, 1e-3):.1f}x | "
                  f"{torch.equal(outs['unpacked'], outs['packed'])} |")


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def large_vocab_folder() -> str:
    """A 2-layer Qwen2 with random weights and a 151,936-token byte-level BPE of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for name in sorted(glob.glob(f"{sys.prefix}/lib/python3*/**/*.py", recursive=True)):
            try:
                with open(name, encoding="utf-8") as f:
                    yield f.read()
            except (UnicodeDecodeError, OSError):
                continue

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=151936, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tempfile.mkdtemp()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    vocab = tokenizer.get_vocab_size()
    config = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def generation_section(title: str, target: str, drafters: dict) -> None:
    print(f"\n{title}")
    print("| grammar | drafter | unpacked tok/s | packed tok/s | ratio | tau | outputs equal |")
    print("|---|---|---|---|---|---|---|")
    for grammar_name, grammar in GRAMMARS.items():
        for name, drafter in drafters.items():
            dec = draftsman.load({"target": {"path": target}, "drafter": drafter,
                                  "sampling": {"structured_output": grammar}})
            dec.generate(PROMPTS[:1], max_new_tokens=8)  # warm: the grammar's tokenizer view is built once
            speed, outputs, tau = {w: [] for w in WAYS}, {w: [] for w in WAYS}, []
            for prompt in PROMPTS:
                for way in WAYS:
                    use(way)
                    start = time.perf_counter()
                    out = dec.generate([prompt], max_new_tokens=48, temperature=0.0)
                    speed[way].append(len(out.token_ids[0]) / (time.perf_counter() - start))
                    outputs[way].append(out.token_ids)
                    tau.append(out.stats.tau)
            use("packed")
            assert outputs["unpacked"] == outputs["packed"], (grammar_name, name)
            before, after = (statistics.median(speed[w]) for w in WAYS)
            print(f"| {grammar_name} | {name} | {before:.1f} | {after:.1f} | {after / before:.2f}x | "
                  f"{statistics.mean(tau):.2f} | {len(PROMPTS)}/{len(PROMPTS)} |")


def main() -> None:
    device = sys.argv[2] if sys.argv[1:2] == ["masking"] and len(sys.argv) > 2 else "cpu"
    if device == "cpu":  # as this project's CI machine; on a GPU host the old way unpacks on all its cores
        torch.set_num_threads(min(2, torch.get_num_threads()))
    masking_section(device)
    if sys.argv[1:2] == ["masking"]:
        return
    start = time.perf_counter()
    folder = large_vocab_folder()
    print(f"\n(the 151,936-token BPE and the Qwen2 built in {time.perf_counter() - start:.0f} s)")
    generation_section("2. Generation, the 2-layer Qwen2 with 151,936 tokens", folder, {
        "none": {"name": "none"}, "draft_model": {"name": "draft_model", "path": folder, "k": 4}})
    generation_section("3. Generation, the bundled target (8192 tokens)", "zoo/python-target", {
        "none": {"name": "none"}, "ngram": {"name": "ngram"},
        "eagle3": {"name": "eagle", "path": "zoo/python-eagle3", "quantize": "int8", **INT8_EAGLE3_TREE}})


if __name__ == "__main__":
    main()
