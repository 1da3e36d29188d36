"""Loading targets and draft models from local folders with the real Hugging Face loaders, with
errors that say what is wrong and how to fix it."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, DynamicCache
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def resolve_device(device: str | torch.device) -> torch.device:
    """auto -> cuda where there is one, else cpu. A device this machine lacks is named here, at load,
    not as torch's "Torch not compiled with CUDA enabled" assertion from deep in a model's .to()."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use auto (cuda where there is one, else cpu), cpu, cuda or "
                         f"cuda:N") from e
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU "
                             "(a CPU build, or no GPU here): use device auto (cuda where there is one) or cpu")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {str(device)!r} asked for, but this machine has {count} CUDA GPU(s): "
                             f"cuda:0 to cuda:{count - 1}")
    return resolved


def native_bfloat16(device: str | torch.device) -> bool:
    """Whether bfloat16 math runs natively here. A CPU without it (AVX2 only) emulates it: a
    512x512 matmul took 98 ms in bfloat16 against 16 ms in float32 on such a 2-core machine, and a
    head drafting in bfloat16 there is slower, not faster."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # oneDNN's own check (AVX512 / AMX)
    except (AttributeError, RuntimeError):
        return False


def check_dtype_name(name: str) -> None:
    """Fail early, at config time, on a dtype name resolve_dtype would not know."""
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid dtypes: {sorted(DTYPES) + ['auto']}")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name, or "auto": bfloat16 where the device runs it natively, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    check_dtype_name(dtype)
    if DTYPES[dtype] == torch.bfloat16 and not native_bfloat16(device):
        warnings.warn(f"dtype bfloat16 on {torch.device(device)}, which has no native bfloat16 math: it runs "
                      "several times slower than float32 here; use dtype: auto or float32", stacklevel=2)
    return DTYPES[dtype]


def check_model_folder(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if p.is_file():  # (it said the folder "does not exist")
        raise FileNotFoundError(f"{what}: '{p}' is a file, not a model folder: give the folder that holds it and "
                                "its config.json")
    if not p.is_dir():
        raise FileNotFoundError(f"{what}: model folder '{p}' does not exist; point the config at a local "
                                "Hugging Face model folder (with config.json and weights)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what}: '{p}' has no config.json; it is not a Hugging Face model folder")
    return p


def load_causal_lm(path, dtype="float32", device="cpu", what="model"):
    p = check_model_folder(path, what)
    return pretrained_text_model(p, resolve_dtype(dtype, device), what).to(resolve_device(device)).eval()


def heads_drafter(kind) -> str | None:
    """The drafter that loads heads of this `kind` (a heads folder's config.json), or None."""
    return {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle", "mtp": "mtp"}.get(kind)


def pretrained_text_model(folder, dtype: torch.dtype, what: str = "model") -> torch.nn.Module:
    """The causal LM in a model folder: a causal LM's, or an image-text model's text model."""
    folder = check_model_folder(folder, what)  # (training reads targets through here, not load_causal_lm)
    folder_config = json.loads((folder / "config.json").read_text())
    model_type = folder_config.get("model_type")
    kind = folder_config.get("kind")
    drafter = heads_drafter(kind)
    if drafter is not None:  # heads this package trained: no model class reads them
        raise ValueError(f"{what}: '{folder}' holds {kind} heads (draftsman train {kind}), which draft from a target's "
                         f"hidden states and are not a causal LM: use drafter: {drafter} with path set to this folder")
    if model_type == "mlp_speculator":  # no model class in transformers: AutoConfig would not know it
        raise ValueError(f"{what}: '{folder}' holds an MLP speculator (model_type mlp_speculator), which drafts from "
                         "a target's hidden states and is not a causal LM: use drafter: mlp_speculator with path set "
                         "to this folder")
    config = AutoConfig.from_pretrained(folder)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        check_cache_support(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config, what)
        loader = AutoModelForCausalLM
    elif type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:  # Mistral 3, ...: its text model is taken below
        loader = AutoModelForImageTextToText
    else:
        raise ValueError(f"{what}: '{folder}' holds a '{config.model_type}' model, which is neither a causal LM nor "
                         "an image-text model around one: draftsman drafts and verifies with causal LMs")
    return text_model(loader.from_pretrained(folder, dtype=dtype))


def check_cache_support(model_class: type, config, what: str = "model") -> None:
    """Refuse, by name, a model whose state lives outside the Hugging Face cache draftsman passes
    it: that cache is what the verifier takes back to the accepted drafts (RWKV's `state`, xLSTM's
    and MiniMax's caches of their own, RecurrentGemma's recurrent blocks, which hold their state in
    the modules); or a model with attention that takes no position_ids (BART's and TrOCR's
    decoders, RoFormer), which numbers positions by the cache's length, and in draftsman's cache
    (holes: rejected drafts, rows of different lengths) that is not a token's position."""
    problem = _state_problem(model_class, config)
    if problem and ("Gemma4Assistant" in model_class.__name__ or "Gemma4UnifiedAssistant" in model_class.__name__):
        raise NotImplementedError(f"{what}: '{config.model_type}' is a Gemma 4 assistant, which drafts from its "
                                  "target's own keys: use drafter: gemma4_assistant with path set to this folder "
                                  "(gemma4_unified_assistant is not supported yet)")
    if problem:
        raise NotImplementedError(f"{what}: '{config.model_type}' ({model_class.__name__}) {problem}, so its output "
                                  "could not be kept exact: not supported; verify and draft with an attention, "
                                  "hybrid or Mamba model")


def _state_problem(model_class: type, config) -> str | None:
    """Why draftsman's cache cannot hold the model's state (check_cache_support), or None."""
    params = inspect.signature(model_class.forward).parameters
    elsewhere = "not in the Hugging Face cache that draftsman passes and takes back to the accepted drafts"
    if "cache" not in params and "past_key_values" not in params:
        own = [name for name in ("state", "mems", "past_buckets_states") if name in params]
        return (f"keeps its state in an argument of its own (`{own[0]}`), {elsewhere}" if own else
                "takes no cache at all: each pass would start from an empty context")
    if not getattr(model_class, "_supports_default_dynamic_cache", lambda: True)():
        return f"keeps its state in a cache class of its own (Hugging Face's generate builds it one too), {elsewhere}"
    if hasattr(model_class, "_setup_cache"):
        return f"keeps its state in its modules (they set it up and update it themselves), {elsewhere}"
    if "position_ids" not in params and not all(type(layer) is LinearAttentionLayer
                                                for layer in DynamicCache(config=config).layers):
        return ("takes no position_ids: it derives positions from its cache's length or its attention mask, which "
                "in draftsman's cache (holes where drafts were rejected or rows differ in length) are not positions")
    return None


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM of a multimodal checkpoint's text config, around the checkpoint's own language
    model and LM head: for image-text classes (Gemma 3's and Gemma 4's, which AutoModelForCausalLM
    gives, Mistral 3's), whose forward masks for images and whose config keeps the text settings
    one level down; draftsman drafts and verifies text. The vision tower is let go. Other models
    pass through."""
    text_config = model.config.get_text_config()
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    if text_config is model.config or language_model is None:
        return model
    text_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text_config), None)
    if text_class is None:
        raise NotImplementedError(f"'{model.config.model_type}' is a multimodal model whose text config "
                                  f"({type(text_config).__name__}) has no causal LM class to verify text with "
                                  "(Qwen2.5-VL and Qwen3-VL's position their text in three dimensions): not "
                                  "supported yet; verify with the family's text model (Qwen2.5, Qwen3)")
    with torch.device("meta"):  # the modules are the checkpoint's: build the shell only
        text = text_class(text_config)
    text.model, text.lm_head = language_model, model.get_output_embeddings()
    if any(p.is_meta for p in text.parameters()):
        raise NotImplementedError(f"{text_class.__name__} has parts the multimodal '{model.config.model_type}' "
                                  "checkpoint does not hold")
    text.generation_config = model.generation_config  # its end tokens
    text.config._name_or_path = model.config._name_or_path
    return text


def load_tokenizer(path):
    """The folder's tokenizer, or None when it has none (token ids still work)."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(p)


UNBOUNDED_CONTEXT = 1 << 30  # a model of recurrent layers only (Mamba) has no position limit



# Tokenized as part of the fingerprint: two tokenizers with one vocabulary may still split text
# differently (normalizers, pre-tokenizers), and then ids stored from one are not the other's.
_PROBE = "def f(x, y=1):\n    return x  # café, naïve ✓\n\n\tEnd. 2024 ->  spaced"


def tokenizer_fingerprint(tokenizer) -> str:
    """Hex digest of the tokenizer's vocabulary and of how it splits a probe text: what decides the ids
    of text tokenized without special tokens (a retrieval datastore, a training token cache)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    probe = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    blob = json.dumps([vocab, probe], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def context_length(config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    if all(isinstance(layer, LinearAttentionLayer) for layer in DynamicCache(config=config).layers):
        return UNBOUNDED_CONTEXT
    raise ValueError(f"cannot tell the context length of model type '{config.model_type}': its config "
                     "has none of max_position_embeddings / n_positions")


def verified_context(config) -> tuple[int, str]:
    """(positions, why): how far a generation may run with output exact to the target's own, and why
    that is short of its context ("" when it is not). A longrope target (the long-context Phi-3,
    Phi-3.5 and Phi-4-mini) rotates every position with other frequencies once a sequence passes
    original_max_position_embeddings; its generate then computes the whole cache again with them.
    A verify pass cannot take that switch mid-generation, and a pass whose positions straddle it
    rotates all of them the long way: within the original positions every pass stays short."""
    context = context_length(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or {}
    for params in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]):
        if params.get("rope_type") != "longrope":
            continue
        switch = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                          None)
        if isinstance(switch, int) and 0 < switch < context:
            return switch, (f"this longrope target switches its RoPE frequencies past original_max_position_embeddings "
                            f"= {switch} (of {context} positions), which speculative decoding cannot reproduce "
                            f"exactly yet: prompt and output together are kept within {switch} tokens")
    return context, ""


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def vocab_mismatch(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> str | None:
    """Why a drafter's vocabulary can't be verified against the target's, or None if it can."""
    if draft_vocab < target_vocab:
        return (f"the drafter's output layer has {draft_vocab} tokens, the target's {target_vocab}")
    if target_tok is None or draft_tok is None:
        return None
    if len(target_tok) != len(draft_tok):
        return f"the tokenizers have {len(target_tok)} (target) and {len(draft_tok)} (drafter) tokens"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if a != b:
            return f"{name} is {a} in the target's tokenizer and {b} in the drafter's"
    # get_vocab() builds a fresh dict on every call: take each once (vocabularies run to 100k+).
    target_map, draft_map = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_map != draft_map:
        # Name the lowest-id difference, so the message is the same on every run.
        for a, b, a_name, b_name in ((target_map, draft_map, "target", "drafter"),
                                     (draft_map, target_map, "drafter", "target")):
            for token, i in sorted(a.items(), key=lambda item: item[1]):
                if b.get(token) != i:
                    there = f"id {b[token]}" if token in b else "no id"
                    return f"token {token!r} has id {i} in the {a_name} but {there} in the {b_name}"
    return None
