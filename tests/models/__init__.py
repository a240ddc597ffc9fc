"""Model tests: tiny models end to end on the CPU. Built-in workloads (tiny-llama, tiny-deepseek, fake-weight
captures of full-size configs), torch.nn and Hugging Face models captured, planned, lowered, run by the runtimes,
through train_step and the Inductor backend. Tests that drive the command line belong in tests/cli."""
