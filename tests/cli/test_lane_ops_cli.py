"""Lane ops through the commands: a sweep over NSA block sizes, the flag's errors, and what ``plan`` says of a
decode step whose KV cache it keeps in remote memory."""

from __future__ import annotations

from hyperoffload.cli import main


def test_sweep_over_nsa_block_sizes(capsys):
    code = main(["sweep", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "2", "--context", "2000",
                 "--hardware", "h200", "--budget", "80%", "--vary", "nsa-block", "--values", "16,32",
                 "--policies", "hyperoffload,paged", "--json"])
    assert code == 0
    import json
    rows = json.loads(capsys.readouterr().out)
    assert {(r["value"], r["policy"]) for r in rows} == {(v, p) for v in ("16", "32") for p in ("hyperoffload", "paged")}
    assert all(r["feasible"] for r in rows)


def test_nsa_block_flag_errors_name_the_problem(capsys):
    assert main(["plan", "--workload", "tiny-llama", "--mode", "decode", "--hardware", "h200", "--budget", "80%",
                 "--nsa-block", "32"]) != 0
    assert "has no NSA" in " ".join(capsys.readouterr().err.split())


def test_plan_json_says_where_the_kv_cache_is(capsys):
    import json

    args = ["plan", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "4", "--context", "20000",
            "--hardware", "h200", "--budget", "40%", "--json"]  # the cache is most of the peak
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv"] == "remote" and out["pool_blocks"] >= 4 and out["feasible"]
    assert 0 < out["fetch_share"] < 1 and out["reselection"] == 0.75
    assert out["dependency_bound_s"] <= out["step_s"] * (1 + 1e-9)  # summed in another order
    assert main([*args[:-1], "--policy", "kv-naive", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"] == "device"


def test_plan_says_which_peak_the_excess_of_a_remote_kv_step_is_measured_from(capsys):
    """The figures of a plan that runs the remote-KV form are that form's: its excess is measured from its own
    peak (the cache is remote), which can leave excess_bytes at 0; the text says so and gives both peaks."""
    args = ["plan", "--workload", "tiny-deepseek", "--mode", "decode", "--batch", "4", "--context", "20000",
            "--hardware", "h200", "--budget", "40%"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, whatever the console's wrapping
    assert "excess_bytes and bound_s are measured from this form's no-offload peak" in out
    assert "with the KV cache on the device the step peaks at" in out
    # the link bound is of the form the plan runs: another form of the step can be faster than another's bound
    assert "no plan of this form of the step (its KV cache remote), in any order, can beat link_bound_s" in out
