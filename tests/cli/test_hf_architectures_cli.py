"""``--workload hf:PATH`` of tiny non-causal configs through the commands: inspected against eager and run planned."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_configs import SEQ, TASK_ARCHITECTURES  # noqa: E402


@pytest.mark.parametrize("arch", ["t5", "vit", "whisper"])
def test_cli_inspects_and_runs_a_task_config(tmp_path, capsys, arch: str) -> None:
    """``--workload hf:PATH`` of a non-causal config: inspected with --verify (graph against eager, real weights),
    and run planned at half its peak, bit-identical to the unplanned step."""
    import json

    from hyperoffload.cli import main

    sizes, task, _ = TASK_ARCHITECTURES[arch]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": arch, **sizes}))
    step = ["--workload", f"hf:{tmp_path}", "--mode", "train", "--batch", "2"]
    if arch != "vit":
        step += ["--seq", str(SEQ)]
    assert main(["inspect", *step, "--verify", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["task"] == task and figures["model_type"] == arch
    assert figures["verify"]["identical_to_eager"]
    assert main(["run", *step, "--budget", "50%", "--link", "10GB/s", "--steps", "1", "--warmup", "0",
                 "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["max_abs_diff"] == 0.0 and ran["feasible"]
