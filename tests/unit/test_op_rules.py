import torch

from hyperoffload.op_rules import OpCall, count_flops, undeclared_writes


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


def test_conv_backward_counts_only_the_gradients_it_computes():
    """``convolution_backward`` without the input's gradient (a network's first conv) returns None in its place:
    torch's formula reads gradients by position, so it is handed the result as returned."""
    names = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups", "output_mask")
    x, w, g = torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3), torch.empty(2, 4, 8, 8)
    grad_w, grad_b = torch.empty(4, 3, 3, 3), torch.empty(4)

    def flops(mask, result):
        args = [g, x, w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask]
        outputs = tuple(t for t in result if t is not None)
        return count_flops(OpCall(target="aten.convolution_backward", args=tuple(args), kwargs={},
                                  inputs=(g, x, w), outputs=outputs, argument_names=names, result=result))

    per_gradient = 2 * 2 * 8 * 8 * 4 * 3 * 3 * 3  # one conv's multiply-adds, 2 FLOPs each
    assert flops([False, True, True], (None, grad_w, grad_b)) == per_gradient
    assert flops([True, True, True], (torch.empty(2, 3, 8, 8), grad_w, grad_b)) == 2 * per_gradient


def test_batch_norm_in_training_writes_its_running_statistics():
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    x, stats = torch.empty(2, 4, 3, 3), torch.empty(4)
    for training, written in ((True, ("running_mean", "running_var")), (False, ())):
        args = (x, stats, stats, stats, stats, training, 0.1, 1e-5)
        call = OpCall(target="aten.native_batch_norm", args=args, kwargs={}, inputs=(x, stats), outputs=(x,),
                      argument_names=names)
        assert undeclared_writes(call) == written
