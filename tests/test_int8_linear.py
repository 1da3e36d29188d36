"""int8 weights for drafters (drafters/int8_linear.py): each output row keeps its own scale,
GPT-2's Conv1D converts like a Linear, every product inside a module is replaced, and the option
checks name the problem. Exactness with int8 heads: tests/test_feature_heads.py; with an int8 draft
model: tests/test_greedy_equality.py, tests/test_engine_sampling.py, tests/test_draft_vocab.py."""
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from draftsman.drafters.int8_linear import Int8Linear, check_quantize, quantize_linears, resolve_quantize


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Largest error of each output feature relative to that feature's own size."""
    return (out - ref).abs().amax(0) / ref.abs().amax(0)


def test_every_output_row_keeps_its_own_precision():
    """Rows whose weights differ in size by 1000x: a scale per row quantizes each to a few % (7-bit
    activations, 8-bit weights); one scale for the whole matrix would leave the small rows with
    almost no levels, which the variant below shows."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=True)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-3, 0, 64)[:, None])
        linear.bias.mul_(torch.logspace(-3, 0, 64))
    x = torch.randn(32, 256)
    ref = linear(x).detach()
    assert float(_row_errors(Int8Linear.of(linear)(x), ref).max()) < 0.06

    w = linear.weight.detach()
    per_tensor = Int8Linear(w.abs().amax() / 127 * torch.round(w / (w.abs().amax() / 127)), linear.bias)
    assert float(_row_errors(per_tensor(x), ref)[:8].min()) > 0.1  # the broken variant is caught


def test_inputs_of_any_shape_and_float_dtype():
    torch.manual_seed(1)
    linear = nn.Linear(32, 16, bias=False)
    q = Int8Linear.of(linear)
    x = torch.randn(2, 3, 32)
    out = q(x)
    assert out.shape == (2, 3, 16) and out.dtype == torch.float32
    torch.testing.assert_close(q(x.bfloat16()), q(x.bfloat16().float()))
    torch.testing.assert_close(q(x[:, :, :64].transpose(0, 1)), out.transpose(0, 1))  # non-contiguous
    ref = linear(x).detach()
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.06


def test_conv1d_converts_like_the_linear_it_is():
    torch.manual_seed(2)
    conv = Conv1D(24, 40)  # GPT-2: weight (in 40, out 24)
    x = torch.randn(5, 40)
    ref = conv(x).detach()
    assert float((Int8Linear.of(conv)(x) - ref).abs().max() / ref.abs().max()) < 0.06
    with pytest.raises(TypeError, match="cannot quantize a Embedding"):
        Int8Linear.of(nn.Embedding(4, 4))


def test_quantize_linears_replaces_every_product_inside():
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.ModuleDict({"a": nn.Linear(8, 4), "c": Conv1D(4, 8)}),
                          nn.LayerNorm(8))
    assert quantize_linears(block) == 3
    assert isinstance(block[0], Int8Linear) and isinstance(block[2]["a"], Int8Linear)
    assert isinstance(block[2]["c"], Int8Linear) and isinstance(block[3], nn.LayerNorm)
    assert not any(isinstance(m, (nn.Linear, Conv1D)) for m in block.modules())


@pytest.mark.parametrize("quantize,dtype,message", [
    ("int4", None, r"quantize must be one of \['int8', 'auto'\] or unset, got 'int4'"),
    ("int8", "bfloat16", "computes around its int8 products in float32; leave dtype unset"),
])
def test_bad_quantize_options_are_named(quantize, dtype, message):
    with pytest.raises(ValueError, match=message):
        check_quantize("eagle", quantize, dtype)


def test_quantize_int8_accepts_float32_compute_only_and_auto_any_dtype():
    for dtype in (None, "auto", "float32"):
        check_quantize("eagle", "int8", dtype)
    check_quantize("eagle", "auto", "bfloat16")  # bfloat16 where int8 does not run
    check_quantize("eagle", None, "bfloat16")


def test_int8_runs_on_the_cpu_only_and_auto_follows_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_quantize("eagle", "int8", cpu) == "int8"
    assert resolve_quantize("eagle", "auto", cpu) == "int8"
    assert resolve_quantize("eagle", "auto", gpu) is None
    assert resolve_quantize("eagle", None, cpu) is None
    with pytest.raises(ValueError, match="quantize: int8 runs on CPU only.*the target is on cuda:0: use quantize: auto"):
        resolve_quantize("eagle", "int8", gpu)
