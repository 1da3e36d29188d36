"""`native_mtp`: the MTP layers a target's own checkpoint ships, drafting through the shared
verifier. Tiny random targets whose configs name MTP layers (DeepSeek-V3 with MLA and a mixture of
experts; GLM-4.5, a mixture of experts with q/k norms and attention biases; Mellum, Qwen3-MoE-like;
the hybrids Qwen3-Next and Qwen3.5), their MTP weights written in each checkpoint's own layout
(DeepSeek's and GLM's model.layers.N.*, the others' mtp.*), loaded by Hugging Face's MtpModel."""
import collections
import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, DeepseekV3Config, Glm4MoeConfig,
                          MellumConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3NextConfig, modeling_layers)
from transformers.modeling_layers import MtpModel

import draftsman

from test_engine_sampling import assert_sampled_marginals_fit
from tiny_models import load_for_reference

PROMPTS = [[5, 17, 33, 40, 2, 9], [7, 8, 9, 10], [3, 3, 3], [11, 12, 13, 14, 15, 16, 17]]
NEW = 16
D = 32


def _configs(vocab_size: int, eos: int, bos: int) -> dict:
    common = dict(vocab_size=vocab_size, hidden_size=D, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=4, num_mtp_layers=1, max_position_embeddings=256, eos_token_id=eos,
                  bos_token_id=bos)
    # DeepSeek-V3's MTP keys are model.layers.61.* (Hugging Face looks for that index): 61 layers.
    deepseek = DeepseekV3Config(num_hidden_layers=61, num_key_value_heads=4, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, **common)
    # GLM-4.5's MTP keys are model.layers.46.* (or .92.*, GLM-4.5's own depth): Hugging Face looks
    # for those two, so 46 layers; all but the top one dense (a mixture of experts costs most here),
    # so the top layer and the MTP layer copied from it are MoE, as GLM-4.5's are.
    glm = Glm4MoeConfig(num_hidden_layers=46, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=45, use_qk_norm=True,
                        attention_bias=True, **common)
    # One sliding layer, as Mellum's: its MTP layer slides too (and needs that layer kind's RoPE).
    mellum = MellumConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], **common)
    # Inkling's MTP checkpoints order the fused input [hidden; embedding]; Hugging Face reads this flag.
    hidden_first = MellumConfig(**{**mellum.to_dict(), "mtp_hidden_states_first": True})
    # Hybrids whose configs say mtp_num_hidden_layers (Hugging Face loads no MTP for them itself);
    # the top of their 4 layers attends, the rest are linear attention.
    hybrid = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=2,
                  linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, mtp_num_hidden_layers=1,
                  **{k: v for k, v in common.items() if k not in ("num_mtp_layers", "moe_intermediate_size")})
    qwen3_next = Qwen3NextConfig(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                                 num_experts_per_tok=2, **hybrid)
    return {"deepseek_v3": deepseek, "mellum": mellum, "mellum_hidden_first": hidden_first,
            "qwen3_next": qwen3_next, "qwen3_5": Qwen3_5TextConfig(**hybrid),
            # last, so the others keep their seeds (40 + i): with another, Qwen3-Next's MTP layer picks EOS
            # where min_new_tokens bans it, which the drafts test's plain argmax does not
            "glm4_moe": glm}


def _mtp_keys(arch: str, n_layers: int) -> tuple[str, dict[str, str]]:
    """Where the checkpoint keeps its MTP layer: the decoder block's prefix, and its other parts."""
    if arch in ("deepseek_v3", "glm4_moe"):
        at = f"model.layers.{n_layers}."
        return at, {"eh_proj": at + "eh_proj", "enorm": at + "enorm", "hnorm": at + "hnorm",
                    "post_norm": at + "shared_head.norm"}
    return "mtp.layers.0.", {"eh_proj": "mtp.fc", "enorm": "mtp.pre_fc_norm_embedding",
                             "hnorm": "mtp.pre_fc_norm_hidden", "post_norm": "mtp.norm"}


def write_mtp_weights(folder, arch: str, n_layers: int, seed: int, layers: str = "model.layers.") -> None:
    """Add an MTP layer to a saved checkpoint, as the model's release ships it: its decoder block a
    perturbed copy of the top layer (in the checkpoint's own key names, under `layers`), the rest random."""
    tensors = load_file(folder / "model.safetensors")
    block, parts = _mtp_keys(arch, n_layers)
    g = torch.Generator().manual_seed(seed)
    top = f"{layers}{n_layers - 1}."
    for key, value in list(tensors.items()):
        if key.startswith(top):
            tensors[block + key[len(top):]] = value + 0.02 * torch.randn(value.shape, generator=g)
    tensors[parts["eh_proj"] + ".weight"] = 0.2 * torch.randn(D, 2 * D, generator=g)
    for name in ("enorm", "hnorm", "post_norm"):
        tensors[parts[name] + ".weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_tokenizer):
    """{arch: (folder, greedy outputs of Hugging Face's generate for PROMPTS)}."""
    out = {}
    configs = _configs(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id)
    for i, (arch, config) in enumerate(configs.items()):
        folder = tmp_path_factory.mktemp(arch)
        tiny_tokenizer.save_pretrained(folder)
        torch.manual_seed(40 + i)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        write_mtp_weights(folder, arch, config.num_hidden_layers, seed=50 + i)
        keys = load_file(folder / "model.safetensors")
        assert arch in ("deepseek_v3", "glm4_moe") or any(k.startswith("mtp.") for k in keys)
        reference = load_for_reference(folder)
        out[arch] = (folder, [reference.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                                 do_sample=False)[0, len(p):].tolist() for p in PROMPTS])
    return out


GREEDY_ARCHS = ["deepseek_v3", "glm4_moe", "mellum", "qwen3_next", "qwen3_5"]


def make_accepting(source, folder, arch: str, n_layers: int, scale: float = 10.0) -> None:
    """A copy of a target whose MTP layer agrees with it often. A random target and its random MTP
    layer almost never do (about 1.0 tokens a round), which leaves the accepted path untried: several
    tokens committed in a round, and the head's cache and the features it is fed after them. Here
    the embeddings are `scale` times larger, so each position's state leans on its own token (the
    layers still add its context), and `scale` * I is added to the fusion's embedding half, so the
    MTP layer reads mostly the token it is given: both then predict mostly from the same token. (An
    LM head skewed toward a few tokens was tried too: acceptance came and went with the seed.)"""
    folder.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(source / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] * scale
    fuse = _mtp_keys(arch, n_layers)[1]["eh_proj"] + ".weight"  # [embedding; hidden] -> D
    tensors[fuse] = tensors[fuse] + torch.cat([scale * torch.eye(D), torch.zeros(D, D)], dim=1)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def accepting_targets(targets, tmp_path_factory, tiny_tokenizer):
    """{arch: (folder, greedy outputs of plain decoding for PROMPTS)} of make_accepting's copies.
    (Plain decoding, one token a round, is Hugging Face's generate elsewhere; here its batch of 4
    costs a seventh of generate's 4 calls, 3.5 s on DeepSeek-V3's 61 layers.)"""
    configs = _configs(len(tiny_tokenizer), tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id)
    out = {}
    for arch in GREEDY_ARCHS:
        folder = tmp_path_factory.mktemp("accepting") / arch
        make_accepting(targets[arch][0], folder, arch, configs[arch].num_hidden_layers)
        plain = draftsman.load({"target": {"path": str(folder), "device": "cpu"}})
        out[arch] = (folder, plain.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW,
                                            temperature=0.0).token_ids)
    return out


def assert_drafts_were_accepted(stats, depth: int) -> None:
    """Real acceptance: well over one token a round, and beyond depth 1 some round that accepted
    two drafted tokens or more (a multi-token commit, the head fed several features after it)."""
    assert stats.tau >= 1.3, (stats.tau, stats.accepted_at_depth, stats.proposed_at_depth)
    if depth >= 2:
        assert stats.accepted_at_depth[1] > 0, (stats.accepted_at_depth, stats.proposed_at_depth)


def _decoder(folder, **options):
    return draftsman.load({"target": {"path": str(folder), "device": "cpu"},
                           "drafter": {"name": "native_mtp", **options}})


@functools.lru_cache(maxsize=None)
def _hf_target_and_mtp(folder):
    """The target as Hugging Face loads it and its MtpModel, loaded once per folder."""
    target = load_for_reference(folder)
    config = target.config.get_text_config()
    if getattr(config, "mtp_num_hidden_layers", None):  # Qwen's key: named as MtpModel reads it
        config.num_mtp_layers, config.mtp_layer_types = config.mtp_num_hidden_layers, ["full_attention"]
    return target, MtpModel.from_pretrained(target)


def _hf_mtp_logits(folder, *text: int) -> torch.Tensor:
    """Hugging Face's own MTP layer over `text`: its logits for the token two after the second last,
    from the target's features of text[:-1] and the tokens text[1:]."""
    target, mtp = _hf_target_and_mtp(folder)
    text = [t for part in text for t in (part if isinstance(part, list) else [part])]
    with torch.no_grad():
        features = target(input_ids=torch.tensor([text[:-1]]), output_hidden_states=True).hidden_states[-1]
        _, logits, _ = mtp(input_ids=torch.tensor([text[1:]]), last_hidden_states=features, attention_mask=None,
                           position_ids=torch.arange(1, len(text))[None], mtp_cache=None)
    return logits[0, -1].float()


@pytest.mark.parametrize("arch", ["deepseek_v3", "mellum", "mellum_hidden_first", "qwen3_next", "qwen3_5"])
def test_drafts_are_hugging_faces_mtp_predictions(targets, arch):
    """Round 1's root is the prompt's last token; its depth-1 draft, made through the drafter's own
    path (the head's cache, the verifier's features), is the argmax of the logits Hugging Face's
    MtpModel gives from the features before it. Round 2's, after a verified round, too. The head's
    training-path logits match Hugging Face's."""
    folder, expected = targets[arch]
    dec = _decoder(folder, depth=1)
    drafts, contexts = [], []
    propose = dec.drafter.propose
    dec.drafter.propose = lambda rows: contexts.append([list(c) for c in rows]) or drafts.append(propose(rows)) \
        or drafts[-1]
    dec.generate(input_ids=PROMPTS, max_new_tokens=3, min_new_tokens=3, temperature=0.0)
    for round in (0, 1):
        for b, context in enumerate(contexts[round]):
            hf = _hf_mtp_logits(folder, context[:-2], context[-2], context[-1])
            assert drafts[round][b].tokens.tolist() == [int(hf.argmax())], (round, b)
    prompt = PROMPTS[0]
    with torch.no_grad():
        features = load_for_reference(folder)(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        _, logits = dec.drafter.head(features.hidden_states[-1].float(), torch.tensor([prompt[1:] + [expected[0][0]]]))
    torch.testing.assert_close(logits[0, -1], _hf_mtp_logits(folder, prompt[:-1], prompt[-1], expected[0][0]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", GREEDY_ARCHS)
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_output_equals_the_targets_own(targets, accepting_targets, arch, depth):
    """On the random target (drafts rarely accepted) and on its accepting copy (most are). There,
    at depth 3 and batch 1, the last round's depth-1 logits, read through the head's cache after
    the tokens of the rounds before (several a round), are Hugging Face's MtpModel's over the whole
    text: the head was fed the right feature for every accepted token, and kept them all. (Output
    equal to the target's own says nothing of the drafts: the verifier keeps it exact.)"""
    for accepting, (folder, expected) in enumerate((targets[arch], accepting_targets[arch])):
        # batch 1 and a ragged batch of 4 (the accepting copy's depth 1: the batch only)
        for rows in (PROMPTS[:1], PROMPTS) if depth == 3 or not accepting else (PROMPTS,):
            dec = _decoder(folder, depth=depth)
            rounds = []  # (context, depth-1 logits) of each round, batch 1
            if accepting and depth == 3 and len(rows) == 1:
                propose, catch_up = dec.drafter.propose, dec.drafter.catch_up
                dec.drafter.propose = lambda contexts: rounds.append([list(contexts[0])]) or propose(contexts)
                dec.drafter.catch_up = lambda: rounds[-1].append(catch_up()) or rounds[-1][-1]
            out = dec.generate(input_ids=rows, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
            assert out.token_ids == expected[: len(rows)], (accepting, len(rows))
            assert out.stats.proposed_at_depth[depth - 1] > 0  # every depth was drafted
            if accepting:
                assert_drafts_were_accepted(out.stats, depth)
            if rounds:  # the last round's: its cache holds an entry per token before (one target pass)
                context, (_, logits, _) = rounds[-1]
                assert len(rounds) < len(context) - len(rows[0])  # rounds that committed several tokens
                torch.testing.assert_close(logits[0], _hf_mtp_logits(folder, context[:-2], context[-2], context[-1]),
                                           atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"quantize": "int8"},
                                     {"draft_vocab": 64, "vocab_order": "order.json"},
                                     {"top_k": 3, "total_tokens": 8}])
def test_greedy_output_with_the_heads_options_equals_the_targets_own(targets, accepting_targets, tmp_path,
                                                                    options):
    """The options a trained mtp head takes: another compute dtype, int8 weights, drafting among
    the target's N most frequent tokens (a token order file, as `draftsman vocab` writes), and a
    top-k tree instead of a chain. On the random target and on its accepting copy."""
    for accepting, (folder, expected) in enumerate((targets["mellum"], accepting_targets["mellum"])):
        kept = list(range(256, 320))  # the random target's order: tokens 319 down to 0
        if accepting:  # the tokens its output holds first, as a count of its output would rank them
            picked = [t for t, _ in collections.Counter(t for row in expected for t in row).most_common()]
            kept = sorted(picked[:64] + [t for t in range(320) if t not in picked][: 64 - len(picked)])
        if "vocab_order" in options:
            order = tmp_path / f"order{accepting}.json"
            order.write_text(json.dumps({"tokens_by_frequency": kept[::-1] + [t for t in range(319, -1, -1)
                                                                              if t not in kept]}))
            options = {**options, "vocab_order": str(order)}
        dec = _decoder(folder, depth=3, **options)
        if "draft_vocab" in options:  # greedy rounds read only the LM-head rows of those 64 tokens
            assert dec.drafter.vocab_map.tolist() == kept
        trees = []
        propose = dec.drafter.propose
        dec.drafter.propose = lambda rows: trees.extend(propose(rows)) or trees[len(trees) - len(rows):]
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, accepting
        root_children = [t.parents.tolist().count(-1) for t in trees if t.size]
        assert max(root_children) == (3 if "top_k" in options else 1)  # a tree where asked, else chains
        if accepting:
            assert_drafts_were_accepted(out.stats, 3)


@pytest.mark.parametrize("arch", ["deepseek_v3", "mellum"])
def test_the_layer_is_used_as_the_checkpoint_holds_it(targets, arch, monkeypatch):
    """The MTP layer drafts in the target's dtype, never copied to float32 (a DeepSeek-V3 MTP layer
    holds 256 experts), and nothing of the head is left without weights; output equals plain
    decoding's in that dtype."""
    from draftsman.heads import feature_head
    from draftsman.heads.native_mtp import load_native_mtp

    folder = targets[arch][0]
    empty = []  # per body built: whether its own weights were left unmade (meta)
    build = feature_head.AutoModelForCausalLM.from_config

    def recording(*args, **kwargs):
        body = build(*args, **kwargs)
        empty.append(all(p.is_meta for p in body.parameters()))
        return body

    monkeypatch.setattr(feature_head.AutoModelForCausalLM, "from_config", recording)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    head = load_native_mtp(target)
    # bfloat16, but where Hugging Face keeps a weight in float32 in the target's own layers too
    # (DeepSeek-V3's router): the drafter does not cast it either
    top = f"model.layers.{target.config.num_hidden_layers - 1}."
    kept = {name[len(top):]: p.dtype for name, p in target.named_parameters() if name.startswith(top)}
    for name, p in head.named_parameters():
        assert p.dtype == kept.get(name.removeprefix("parts.layers.0."), torch.bfloat16), name
    assert empty == [True]  # every weight the head holds is the checkpoint's or the target's
    plain = draftsman.load({"target": {"path": str(folder), "device": "cpu", "dtype": "bfloat16"}})
    dec = draftsman.load({"target": {"path": str(folder), "device": "cpu", "dtype": "bfloat16"},
                          "drafter": {"name": "native_mtp"}})
    assert [p.dtype for p in dec.drafter.head.parameters()] == [p.dtype for p in head.parameters()]
    expected = plain.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected.token_ids


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_qwens_mtp_key_is_read_and_the_targets_config_left_as_it_was(targets, arch):
    """Qwen3-Next and Qwen3.5 name their MTP layers mtp_num_hidden_layers; the config is given the
    key Hugging Face's MtpModel reads only while it loads (a saved target keeps its own config)."""
    dec = _decoder(targets[arch][0])
    config = dec.target.config.get_text_config()
    assert config.mtp_num_hidden_layers == 1
    assert not hasattr(config, "num_mtp_layers") and not hasattr(config, "mtp_layer_types")
    saved = dec.target.config.to_json_string()
    assert '"num_mtp_layers"' not in saved and '"mtp_layer_types"' not in saved and '"mtp_num_hidden_layers"' in saved


def test_sampling_follows_the_target(targets, T=0.3):
    """At T > 0 a drafted token is drawn from the MTP layer's distribution q, returned with it: the
    emitted first and second tokens follow the target's exact marginals. (A random model's
    distributions are near uniform; a low temperature makes p and q peaked and unlike, so a wrong
    q, or a token not drawn from it, moves what is emitted.)"""
    folder = targets["mellum"][0]
    assert_sampled_marginals_fit(_decoder(folder, depth=2), folder, [1, 2, 3, 4, 5, 1, 2, 3], T)


def test_a_target_without_mtp_layers_is_refused_with_the_fix(tiny_models):
    with pytest.raises(ValueError, match=r"no MTP layers in its config.*draftsman train mtp"):
        _decoder(tiny_models["llama"][0])


def test_mtp_layers_under_a_key_hugging_face_does_not_load_are_named(tiny_models, tmp_path):
    """Nemotron-H's config says num_nextn_predict_layers, which transformers keeps but loads no MTP
    for: named as such, not as "no MTP layers"."""
    source = tiny_models["llama"][0]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(NotImplementedError, match=r"names 1 MTP layer\(s\), but transformers .* loads no MTP "
                                                  r"layers for llama models"):
        _decoder(tmp_path)


def test_a_checkpoint_missing_its_mtp_weights_is_named(targets, tmp_path):
    """A config that names an MTP layer over a checkpoint without its weights (save_pretrained drops
    them): refused at load, not drafted from random weights."""
    source = targets["mellum"][0]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            (tmp_path / name).write_bytes((source / name).read_bytes())
    tensors = {k: v for k, v in load_file(source / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"cannot load the MTP layers .*must hold their weights") as refused:
        _decoder(tmp_path)
    # The advice first, then the first few of transformers' missing keys (a 256-expert layer has hundreds).
    message = str(refused.value)
    assert message.index("must hold their weights") < message.index("layers.0.eh_proj.weight")
    assert message.count("layers.0.") == 5 and message.endswith(" more")


def test_an_image_text_checkpoints_vision_tower_is_not_reported(tiny_tokenizer, tmp_path, monkeypatch):
    """Qwen3.5 is released as an image-text checkpoint. Its text class skips the vision tower, and
    MtpModel read every key that class skips: transformers' load report listed each vision tensor as
    UNEXPECTED (hundreds of lines on a real release). Missing MTP weights are still refused."""
    V = len(tiny_tokenizer)
    text = _configs(V, tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id)["qwen3_5"].to_dict()
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                num_heads=2, out_hidden_size=D),
                           image_token_id=V - 1, video_token_id=V - 2, vision_start_token_id=V - 3,
                           vision_end_token_id=V - 4, tie_word_embeddings=False)
    torch.manual_seed(3)
    folder = tmp_path / "vl"
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    write_mtp_weights(folder, "qwen3_5", 4, seed=7, layers="model.language_model.layers.")
    assert any(k.startswith("model.visual.") for k in load_file(folder / "model.safetensors"))
    reports = []
    report = modeling_layers.log_state_dict_report
    monkeypatch.setattr(modeling_layers, "log_state_dict_report",
                        lambda **kw: reports.append(kw["loading_info"]) or report(**kw))
    plain = draftsman.load({"target": {"path": str(folder), "device": "cpu"}})
    expected = plain.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    out = _decoder(folder, depth=2).generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW,
                                             temperature=0.0)
    assert out.token_ids == expected.token_ids
    assert [sorted(r.unexpected_keys) for r in reports] == [[]]
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"cannot load the MTP layers .*must hold their weights.*eh_proj"):
        _decoder(folder)


@pytest.mark.parametrize("options,message", [
    ({"depth": 0}, "depth must be >= 1"),
    ({"draft_vocab": 64}, "draft_vocab needs vocab_order"),
    ({"vocab_order": "x.json"}, "vocab_order only applies with draft_vocab"),
    ({"path": "heads/"}, r"unknown option\(s\) \['path'\]"),
    ({"top_k": 0}, "top_k must be >= 1"),
    ({"min_confidence": 1.5}, "min_confidence"),
])
def test_bad_options_are_named(targets, options, message):
    with pytest.raises(ValueError, match=message):
        _decoder(targets["mellum"][0], **options)
