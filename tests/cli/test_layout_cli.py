"""``plan --static-layout``: the arena and allocator figures it reports, and its refusal for other policies."""


def test_plan_command_reports_arena_and_allocator_figures(capsys):
    import json

    from hyperoffload.cli import main

    args = ["plan", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--budget", "50%",
            "--json"]
    assert main([*args, "--static-layout"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["static_layout"] is True
    assert result["arena_bytes"] <= result["budget_bytes"] and result["arena_stalls"] == 0
    assert result["peak_bytes"] <= result["arena_bytes"]
    for key in ("allocator_stalls", "allocator_failures", "allocator_reserved_bytes"):
        assert isinstance(result[key], int)
    assert main([*args]) == 0
    assert json.loads(capsys.readouterr().out)["static_layout"] is False
    assert main([*args, "--static-layout", "--policy", "none"]) != 0
    assert "static-layout is a hyperoffload planner option" in capsys.readouterr().err
