"""The training loop and what it calls: methods, losses, optimizers and steppers, EMA, guards, validation, samples."""
