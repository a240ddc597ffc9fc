"""Full-size models captured on fake tensors: nothing is allocated, sizes are exact."""

import pytest
import torch

from hyperoffload.analysis import memory_profile
from hyperoffload.capture import capture_train_step, is_fake
from hyperoffload.ir import ValueKind, kind_bytes
from hyperoffload.workloads import Llama, capture_workload, get_workload
from helpers import assert_matches_eager


def parameter_count(cfg) -> int:
    attn = cfg.hidden * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * cfg.hidden
    block = attn + 3 * cfg.hidden * cfg.ffn + 2 * cfg.hidden
    return cfg.layers * block + 2 * cfg.vocab_size * cfg.hidden + cfg.hidden


@pytest.mark.slow
@pytest.mark.parametrize("name, params", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_full_size_training_step_sizes(name, params):
    workload = get_workload(name)
    assert parameter_count(workload.config) == params  # Meta's published counts
    captured = capture_workload(workload, "train")
    program = captured.program
    assert all(is_fake(t) for t in captured.inputs)
    assert kind_bytes(program, [ValueKind.PARAMETER]) == 2 * params  # bf16
    assert kind_bytes(program, [ValueKind.GRADIENT]) == 2 * params  # bf16
    assert kind_bytes(program, [ValueKind.OPTIMIZER_STATE]) == 8 * params + 4  # two fp32 moments + step
    # Saved activations per layer at least: the inputs of the 7 projections' weight gradients and the
    # attention output, in bf16, batch 1 x 4096 tokens.
    tokens = 4096
    assert kind_bytes(program, [ValueKind.ACTIVATION]) > workload.config.layers * tokens * workload.config.hidden * 2 * 4
    profile = memory_profile(program)
    assert profile.peak_bytes >= 12 * params  # parameters and moments live all step
    # 6 FLOPs per parameter per token is the textbook estimate of a training step (plus attention).
    flops = sum(op.flops for op in program.ops)
    assert 6 * params * tokens * 0.9 < flops < 6 * params * tokens * 1.3


def test_fake_and_real_capture_agree_on_tiny():
    workload = get_workload("tiny-llama")
    fake = capture_workload(workload, "train", fake=True).program
    real = capture_workload(workload, "train", fake=False).program
    assert [op.target for op in fake.ops] == [op.target for op in real.ops]
    assert memory_profile(fake).live_bytes == memory_profile(real).live_bytes


def test_inputs_sharing_a_buffer_are_separated():
    torch.manual_seed(0)
    model = Llama(get_workload("tiny-llama").config)
    stream = torch.randint(0, 512, (2, 17))
    captured = capture_train_step(model, (stream[:, :-1],), stream[:, 1:])
    tokens, targets = captured.inputs[-2:]
    assert tokens.untyped_storage().data_ptr() != targets.untyped_storage().data_ptr()
    assert_matches_eager(captured)


@pytest.mark.parametrize("mode", ["train", "prefill", "decode"])
def test_fake_capture_allocates_nothing(mode):
    captured = capture_workload(get_workload("tiny-llama"), mode, fake=True)
    assert all(is_fake(t) for t in captured.inputs)
