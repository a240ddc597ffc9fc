import torch

from hyperoffload.op_rules import OpCall, count_flops


def call(target, args, outputs, names=()):
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    return OpCall(target=target, args=tuple(args), kwargs={}, inputs=tensors, outputs=tuple(outputs),
                  argument_names=names)


def test_mm_counts_two_flops_per_multiply_add():
    a, b = torch.empty(3, 5), torch.empty(5, 7)
    assert count_flops(call("aten.mm", [a, b], [torch.empty(3, 7)])) == 2 * 3 * 5 * 7


def test_default_rule_counts_elements_of_the_largest_tensor():
    x = torch.empty(4, 6)
    assert count_flops(call("aten.exp", [x], [torch.empty(4, 6)])) == 24
    assert count_flops(call("aten.sum", [x], [torch.empty(())])) == 24


def test_copies_do_no_arithmetic():
    x = torch.empty(4, 6)
    assert count_flops(call("aten.clone", [x], [torch.empty(4, 6)])) == 0


def test_attention_flops_halve_when_causal():
    names = ("query", "key", "value", "dropout_p", "is_causal")
    q = torch.empty(2, 8, 16, 32)
    k = v = torch.empty(2, 2, 16, 32)  # grouped-query: fewer key/value heads
    out = [torch.empty(2, 8, 16, 32)]
    full = count_flops(call("aten._scaled_dot_product_flash_attention_for_cpu", [q, k, v, 0.0, False], out, names))
    causal = count_flops(call("aten._scaled_dot_product_flash_attention_for_cpu", [q, k, v, 0.0, True], out, names))
    assert full == 4 * 2 * 8 * 16 * 16 * 32
    assert causal * 2 == full
    backward_names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    back = count_flops(call("aten._scaled_dot_product_flash_attention_for_cpu_backward",
                            [out[0], q, k, v, out[0], torch.empty(2, 8, 16), 0.0, True], [q, k, v], backward_names))
    assert back == causal * 5 // 2
