"""Layer-level checks that do not need a whole model."""
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear, add_float32_copies, can_prepack, linear, prepack_cpu_weights
from tests.worker.cpu_features import needs_bf16_packing


def _head(vocab_size: int, hidden_size: int) -> LMHead:
    torch.manual_seed(0)
    embedding = VocabEmbedding(vocab_size, hidden_size)
    with torch.no_grad():
        embedding.weight.normal_()
    return LMHead(vocab_size, hidden_size, tied_to=embedding)


def test_prepacked_linear_and_lm_head_equal_plain_matmuls():
    torch.manual_seed(2)
    layer = Linear(48, 2500, bias=True)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    head = _head(3000, 48)
    assert can_prepack(torch.device("cpu"), torch.float32)
    assert prepack_cpu_weights(nn.ModuleList([layer, head])) == 2
    assert layer.weight.numel() == 0  # the plain copy is freed
    assert head.weight.shape == (3000, 48)  # tied: the embedding still needs it
    for num_rows in (1, 7, 200):
        x = torch.randn(num_rows, 48)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_prepacked_unless_the_cpu_multiplies_bf16_natively():
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    assert can_prepack(torch.device("cpu"), torch.bfloat16, native_bf16=True)
    assert not can_prepack(torch.device("cpu"), torch.float16, native_bf16=True)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    assert not can_prepack(torch.device("cuda"), torch.bfloat16, native_bf16=True)


def _bf16_layer_and_head(seed: int) -> tuple[Linear, LMHead]:
    torch.manual_seed(seed)
    layer = Linear(48, 700, bias=True)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    layer.to(torch.bfloat16)
    head = _head(900, 48)
    head.weight.data = head.weight.data.bfloat16()
    return layer, head


@needs_bf16_packing
def test_prepacked_bf16_linear_and_lm_head_multiply_natively_at_every_batch_size():
    layer, head = _bf16_layer_and_head(4)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert prepack_cpu_weights(nn.ModuleList([layer, head])) == 2
    assert layer.weight.numel() == 0 and layer.packed_weight.dtype == torch.bfloat16  # no float32 copy
    assert head.weight.shape == (900, 48)  # tied: the embedding still reads it
    for num_rows in (1, 2, 3, 64):
        x = torch.randn(num_rows, 48).bfloat16()
        with torch.inference_mode():
            out, logits = layer(x), head(x)
        assert out.dtype == logits.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(logits.float(), F.linear(x.float(), head.weight.float()), rtol=1e-2, atol=5e-2)


def test_bf16_linear_widens_above_two_rows_and_matches_float32_math():
    torch.manual_seed(1)
    weight = torch.randn(2100, 48).bfloat16()  # two whole widening chunks and a partial one
    bias = torch.randn(2100).bfloat16()
    for num_rows in (1, 2, 3, 64):
        x = torch.randn(num_rows, 48).bfloat16()
        out = linear(x, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 2100)
        expected = F.linear(x.float(), weight.float(), bias.float())
        # Both round a float32-accumulated result to bfloat16 once (8 bits of mantissa).
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_bf16_lm_head_matches_float32_math():
    head = _head(3000, 64)
    head.weight.data = head.weight.data.bfloat16()
    hidden = torch.randn(16, 64).bfloat16()
    with torch.inference_mode():
        logits = head(hidden)
    expected = F.linear(hidden.float(), head.weight.float())
    torch.testing.assert_close(logits.float(), expected, rtol=1e-2, atol=5e-2)


def test_float32_copies_of_bf16_weights_serve_batches_and_keep_the_16bit_weights():
    layer, head = _bf16_layer_and_head(3)
    assert add_float32_copies(nn.ModuleList([layer, head])) == 2
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (700, 48)  # kept for 1-2 rows
    assert layer.packed_bias.dtype == torch.float32
    for num_rows in (1, 2, 3, 64):
        x = torch.randn(num_rows, 48).bfloat16()
        with torch.inference_mode():
            out, logits = layer(x), head(x)
        assert out.dtype == logits.dtype == torch.bfloat16
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(logits.float(), F.linear(x.float(), head.weight.float()), rtol=1e-2, atol=5e-2)
