"""int8 weights for a drafter's matrix products on CPU (the option `quantize: int8` of `eagle`,
`mtp` and `draft_model`).

A head call is small (an EAGLE head: one decoder layer over 4 nodes), so its products read
weights more than they compute. On the 2-core CPU of docs/benchmarks.md a (4 x 512) @ (512 x 1376)
product took 167 us in float32, 83 us in bfloat16 and 33 us with int8 weights. The bundled
EAGLE-3 head, same tree, ran 1.88x / 1.84x / 1.69x plain decoding against 1.63x / 1.71x / 1.58x in
bfloat16 (continuation / copy / docstring prompts, one process) and drafted about as well (tau
4.74 / 5.12 / 4.31 against 4.68 / 4.99 / 4.36). The EAGLE-1/2 head lost tau in int8 (4.36 -> 4.00).

The kernel is PyTorch's dynamic int8 linear (fbgemm / oneDNN, what torch.ao's dynamic
quantization calls): weights quantized once, symmetric per output row (scale = the row's largest
|w| / 127); activations per call, per tensor, to 7 bits (`reduce_range`, so that the kernel's
16-bit sums cannot saturate on CPUs without VNNI). Everything around the products computes in
float32. Drafts only: whatever the head computes, the verifier keeps the output exact.

PyTorch 2.13 warns that its quantized tensors (which this kernel's weight packing takes) are
deprecated. Where they go, `torch._weight_int8pack_mm` (int8 weights, bfloat16 activations, the
kernel gpt-fast's int8 mode uses) ran as fast here and as well (tau within 0.1 on the bundled
EAGLE-3 head), but only where bfloat16 math is native.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

# "auto": int8 where it runs (a CPU with an int8 engine), else off (then `dtype` applies), so one
# config suits a CPU and a GPU.
QUANTIZE = ("int8", "auto")
_INT8_ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")


def check_quantize(drafter: str, quantize: str | None, dtype: str | None) -> None:
    """Option check, before any model loads."""
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise ValueError(f"{drafter}: quantize must be one of {list(QUANTIZE)} or unset, got {quantize!r}")
    if quantize == "int8" and dtype not in (None, "auto", "float32"):
        raise ValueError(f"{drafter}: quantize: int8 computes around its int8 products in float32; "
                         f"leave dtype unset (or auto / float32), not {dtype!r}")


def int8_runs_on(device: torch.device) -> bool:
    return torch.device(device).type == "cpu" and any(
        e in torch.backends.quantized.supported_engines for e in _INT8_ENGINES)


def resolve_quantize(drafter: str, quantize: str | None, device: torch.device) -> str | None:
    """The option as it applies on `device`: "int8" or None. quantize: int8 where it cannot run
    is an error that says so."""
    if quantize == "auto":
        return "int8" if int8_runs_on(device) else None
    if quantize == "int8" and not int8_runs_on(device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"{drafter}: quantize: int8 runs on CPU only (PyTorch's dynamic int8 linear); "
                             f"the target is on {device}: use quantize: auto (int8 on CPU only) or remove it "
                             "(dtype: bfloat16 reads half the bytes of float32 on a GPU)")
        raise ValueError(f"{drafter}: this PyTorch build has no int8 CPU engine (supported: "
                         f"{torch.backends.quantized.supported_engines}); remove quantize")
    return quantize


class Int8Linear(nn.Module):
    """A bias-optional linear with int8 weights. Reads any float input, returns float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight (out, in) as nn.Linear holds it."""
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # symmetric, per output row
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated (see the module docstring)
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qweight = torch.quantize_per_channel(w.cpu(), scale, zero, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    @classmethod
    def of(cls, layer: nn.Module) -> "Int8Linear":
        """From an nn.Linear or a GPT-2 Conv1D (whose weight is stored (in, out))."""
        if isinstance(layer, nn.Linear):
            return cls(layer.weight, layer.bias)
        if _is_conv1d(layer):
            return cls(layer.weight.t(), layer.bias)
        raise TypeError(f"cannot quantize a {type(layer).__name__}: only Linear and Conv1D layers")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float().contiguous(), self._packed, reduce_range=True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(module: nn.Module) -> int:
    """Replace every Linear / Conv1D inside `module` by an Int8Linear, in place. Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) or _is_conv1d(child):
            setattr(module, name, Int8Linear.of(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count


def quantize_output_layers(output_layers: dict) -> dict:
    """{round kind: (LM head, row -> token id map)} with each distinct head converted once, so a
    head both kinds read stays one module."""
    converted = {id(layer): Int8Linear.of(layer) for layer, _ in output_layers.values()}
    return {kind: (converted[id(layer)], ids) for kind, (layer, ids) in output_layers.items()}


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D (transformers.pytorch_utils), a linear whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")
