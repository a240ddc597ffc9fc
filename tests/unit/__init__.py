"""Unit tests: programs built by hand in the IR (tests/programs.py) and hypothesis strategies over them, planned,
simulated and checked. No model is captured and no command is run here: tests of workloads, torch.nn or Hugging Face
models belong in tests/models, tests of the command line in tests/cli."""
