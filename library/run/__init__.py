"""The run: its stages (trainer), the training loop, the run's declared parts, the checks before
loading and LECO's run; the one package that uses both training and outputs."""
