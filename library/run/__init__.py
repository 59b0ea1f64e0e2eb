"""The run: its stages (trainer), the training loop, the run's declared parts and the checks before loading; uses training and outputs."""
