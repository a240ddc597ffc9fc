"""The DeepSeek-style workload through the commands: inspect of its decode and prefill steps, and a decode step
planned within its budget."""

import json

from hyperoffload.cli import main


def test_cli_inspect_decode_and_prefill(capsys):
    for mode in ("decode", "prefill"):
        assert main(["inspect", "--workload", "tiny-deepseek", "--mode", mode, "--json"]) == 0
        figures = json.loads(capsys.readouterr().out)
        assert figures["params_bytes"] > 0 and figures["flops"] > 0
        assert (figures["kv_bytes"] > 0) == (mode == "decode")


def test_cli_plan_decode_meets_the_budget(capsys):
    assert main(["plan", "--workload", "tiny-deepseek", "--mode", "decode", "--hardware", "h200", "--budget", "75%",
                 "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["peak_bytes"] <= figures["budget_bytes"]
