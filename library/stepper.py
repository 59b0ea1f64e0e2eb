"""How one global batch's gradient becomes one optimizer update.

The training loop calls ``stepper.backward(loss)`` for each micro-step of this process and
``stepper.step()`` once per global batch (every process, every step, even with an empty share).
``PlainStepper`` keeps every gradient until the end of the step: sum across processes, clip the
global norm, one optimizer and one scheduler step. Memory-saving steppers (stepping parameters
inside backward hooks) implement the same two calls.
"""
from __future__ import annotations

from library import distributed


class PlainStepper:
    def __init__(self, accelerator, optimizer, scheduler, params, max_grad_norm: float):
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = params
        self.max_grad_norm = max_grad_norm

    def current_lr(self) -> float:
        """The learning rate the next step uses (first param group)."""
        return self.scheduler.get_last_lr()[0]

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def state_dict(self) -> dict:
        """Everything a resume needs to continue the updates exactly (optimizer(s), scheduler)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def step(self) -> None:
        # Sum, then clip the global batch's gradient (after accumulation and summation, so any
        # split of the global batch clips alike).
        distributed.sum_gradients(self.params)
        if self.max_grad_norm and self.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()  # once per optimizer step, never per micro-step or process
        self.optimizer.zero_grad(set_to_none=True)
