"""What every trainable head shares: a fingerprint of the target it was trained for, and one
checkpoint layout (config.json + model.safetensors, written atomically)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..atomic_files import replaced_together
from ..config import read_json_object

# config.json and model.safetensors of one save share this id (a key of the one, metadata of the
# other). Folders saved before it existed have none and load as before.
SAVE_ID = "save_id"

# Fixed probe positions in the LM head: cheap to compare, and two different targets (or the same
# architecture retrained) differ there with overwhelming probability.
_PROBES = 16


def target_fingerprint(model: torch.nn.Module) -> dict:
    weight = model.get_output_embeddings().weight.detach()
    V, d = weight.shape
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.randint(0, V, (_PROBES,), generator=g), torch.randint(0, d, (_PROBES,), generator=g)
    # Read where the weights are, in float32, without a float copy of the whole head on the CPU
    # (2.5 GB for a 152k x 4096 one): heads and drafter memories take it at every start.
    probes = weight[rows.to(weight.device), cols.to(weight.device)].float().cpu()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {
        "architecture": type(model).__name__,
        "hidden_size": d,
        "vocab_size": V,
        "lm_head_probe": [round(float(x), 4) for x in probes],
        "lm_head_norm": round(float(torch.linalg.vector_norm(weight, dtype=torch.float32)), 3),
        # A depth-pruned model or a fine-tune keeps its LM head: the layers tell those targets apart.
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "body_probe": _body_probe(model, weight),
    }


_BODY_WEIGHTS = 8
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _body_probe(model: torch.nn.Module, head_weight: torch.Tensor) -> list[float | None]:
    """Two seeded values from each of a few weights spread through the layers, picked by position
    among all of them. A weight stored in another form (int8, packed 4-bit, fp8) reads None, so a
    quantized copy of the same target is compared on the weights it keeps in float."""
    embeddings = model.get_input_embeddings().weight
    weights = [p.detach() for p in model.parameters()
               if p is not embeddings and p.data_ptr() != head_weight.data_ptr()]
    if not weights:
        return []
    g = torch.Generator().manual_seed(1)
    values = []
    for i in range(_BODY_WEIGHTS):
        weight = weights[i * (len(weights) - 1) // (_BODY_WEIGHTS - 1)]
        at = torch.randint(0, weight.numel(), (2,), generator=g)
        if weight.dtype not in _FLOAT_WEIGHTS or weight.device.type == "meta":
            values += [None, None]
            continue
        values += [round(float(x), 4) for x in weight.reshape(-1)[at.to(weight.device)].float().cpu()]
    return values


def _same_values(saved: list, now: list) -> bool:
    """Equal within bf16 storage's rounding where both records read the weight; a record of another
    length (an empty one, written before body probes) has nothing to compare."""
    pairs = [(a, b) for a, b in zip(saved, now) if a is not None and b is not None]
    return len(saved) != len(now) or not pairs or torch.allclose(
        torch.tensor([a for a, _ in pairs]), torch.tensor([b for _, b in pairs]), rtol=2e-2, atol=2e-3)


def fingerprint_difference(saved: dict, now: dict) -> str | None:
    """How the target fingerprint `saved` was taken from differs from the one `now` was (both
    target_fingerprint()s); None when it looks the same. Records written before a key existed
    (num_hidden_layers, body_probe) are compared on the keys they hold."""
    keys = ["architecture", "hidden_size", "vocab_size"] + ["num_hidden_layers"] * ("num_hidden_layers" in saved)
    for key in keys:
        if saved.get(key) != now[key]:
            return f"{key} is {saved.get(key)!r} in the record but {now[key]!r} in this target"
    # bf16 storage moves weights by ~0.4%: compare with a tolerance, not bit for bit.
    close = torch.allclose(torch.tensor(saved["lm_head_probe"]), torch.tensor(now["lm_head_probe"]),
                           rtol=2e-2, atol=2e-3)
    if not close or abs(saved["lm_head_norm"] - now["lm_head_norm"]) > 0.02 * now["lm_head_norm"]:
        return "the target's LM head weights differ from the recorded ones"
    if not _same_values(saved.get("body_probe") or [], now["body_probe"]):
        return "the target's layer weights differ from the recorded ones (same LM head: a fine-tune or another model)"
    return None


def check_fingerprint(saved: dict, model: torch.nn.Module, heads_dir: str | Path) -> None:
    """Refuse heads trained for another target: they would give garbage acceptance, not errors."""
    why = fingerprint_difference(saved, target_fingerprint(model))
    if why:
        raise ValueError(f"heads in '{heads_dir}' were trained for another target: {why}. Train heads for "
                         "this target (draftsman train ...) or point target.path at the one they were made for.")


def check_heads_destination(folder: str | Path, what: str = "out", kind: str | None = None) -> None:
    """Heads are saved in a folder, over earlier heads (of `kind`, when given) only: a file, a folder
    holding a model (the target's, a draft model's, a released speculator), weights or metrics
    without a config.json, or another kind's heads would lose what is there."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} '{folder}' is a file: heads are saved in a folder (config.json, model.safetensors, "
                         "metrics.json); give a folder's path")
    config_file = folder / "config.json"
    if not config_file.is_file():
        found = [name for name in ("model.safetensors", "metrics.json") if (folder / name).exists()]
        if found:
            raise ValueError(f"{what} '{folder}' holds {' and '.join(found)} without a config.json: saving heads "
                             "there would replace them. Give the heads a folder of their own")
        return
    config = read_json_object(config_file) or {}
    # Heads this package saved carry a kind, or (an MLP speculator, in its engines' layout) a save id,
    # or, saved before save ids (the bundled zoo/python-mlp-speculator), their target's fingerprint.
    ours = SAVE_ID in config or isinstance(config.get("target"), dict)
    saved_kind = config.get("kind") or (config.get("model_type") if ours else None)
    if saved_kind is None:
        found = f"a {config['model_type']!r} model" if "model_type" in config else "a config.json no heads save wrote"
        raise ValueError(f"{what} '{folder}' holds {found}: saving heads there would replace its config.json and "
                         "model.safetensors. Give the heads a folder of their own (a new one, or earlier heads')")
    if kind is not None and saved_kind != kind:
        raise ValueError(f"{what} '{folder}' holds {saved_kind} heads: saving {kind} heads there would replace them. "
                         f"Give the {kind} heads a folder of their own, or delete that one to start over")


def save_checkpoint(folder: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors, both written before either replaces the last save's (an
    interrupted save leaves the last pair whole). Both carry one save id: load_checkpoint refuses a
    pair from two saves (a kill between the two renames). Never over a model's folder."""
    check_heads_destination(folder, "the heads folder")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_id = uuid.uuid4().hex
    # 0o644: a heads folder is meant to be shared
    with replaced_together([folder / "model.safetensors", folder / "config.json"], mode=0o644) as (weights, cfg):
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(weights),
                  metadata={SAVE_ID: save_id})
        cfg.write_text(json.dumps({**config, SAVE_ID: save_id}, indent=2))


def load_checkpoint(folder: str | Path, kind: str | tuple[str, ...]) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and tensors of a heads folder holding heads of `kind` (or one of several kinds)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"'{folder}' is not a heads folder of kind {' / '.join(kinds)} (config.json + "
                                f"model.safetensors missing); train one with `draftsman train {kinds[0]}`")
    config = read_heads_config(folder / "config.json")
    if "kind" not in config and "model_type" in config:  # a model's folder, e.g. the target's own
        raise ValueError(f"'{folder}' holds a {config['model_type']!r} model, not {' or '.join(map(repr, kinds))} "
                         f"heads: point drafter.path at a heads folder (`draftsman train {kinds[0]}` writes one); a "
                         "small model of the target's vocabulary drafts as drafter draft_model")
    if config.get("kind") not in kinds:
        raise ValueError(f"'{folder}' holds {config.get('kind')!r} heads, not {' or '.join(map(repr, kinds))} heads")
    check_same_save(folder, config)
    return config, load_file(str(folder / "model.safetensors"))


def read_heads_config(path: Path) -> dict:
    """A heads (or speculator) folder's config.json as a dict; a broken one is refused by its path
    (json's own message names only a line and column)."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"'{path}' is not valid JSON ({e}): restore it from a copy, or save or train the heads "
                         "again") from None
    if not isinstance(config, dict):
        raise ValueError(f"'{path}' holds a JSON {type(config).__name__}, not the object a heads config.json is: "
                         "restore it from a copy, or save or train the heads again")
    return config


def load_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], folder: str | Path) -> None:
    """module.load_state_dict(tensors); weights that do not fit the module its config.json builds (the
    files of two different heads) are refused naming the folder and the fix, torch's list of the
    mismatched, missing and unexpected tensors on one line (its traceback named neither)."""
    try:
        module.load_state_dict(tensors)
    except RuntimeError as e:
        raise ValueError(f"config.json and model.safetensors in '{folder}' do not belong together (the files of two "
                         f"different heads?): {' '.join(str(e).split())} Copy both files from one heads folder, or "
                         "train the heads again") from None


def check_same_save(folder: Path, config: dict) -> None:
    """Refuse a config.json and model.safetensors that save_checkpoint wrote in two different saves
    (a folder without model.safetensors, e.g. a released pytorch_model.bin one, has nothing to compare)."""
    if not (folder / "model.safetensors").is_file():
        return
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        weights_id = (f.metadata() or {}).get(SAVE_ID)
    if config.get(SAVE_ID) and weights_id and config[SAVE_ID] != weights_id:
        raise ValueError(f"config.json and model.safetensors in '{folder}' come from two different saves (one "
                         "was stopped between writing the two); save or train the heads again, or restore "
                         "the folder from a copy")
