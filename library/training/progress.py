"""How far a run has got: ``Progress`` is written by the loop after each step and by a resume
(``train_state.load_state`` returns the saved one); a training state saves and restores exactly
this record (``state_dict`` / ``from_state``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the statistics' module imports torch
    from library.training.network_options import MaxNormStats


@dataclass(slots=True)
class Progress:
    """Counters and logs of a run; a training state saves and restores exactly this."""

    global_step: int = 0
    epochs_done: int = 0             # epochs completed (the metadata's ss_epoch)
    samples_seen: int = 0
    position: tuple[int, int] = (1, 0)  # (epoch, index of the next global batch in it)
    loss_log: list[float] = field(default_factory=list)  # per step: the global batch's mean loss
    lr_log: list[float] = field(default_factory=list)    # per step: the first group's learning rate
    val_log: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    # scale_weight_norms: the last step's statistics (on the device, or as read from a state)
    max_norm_stats: MaxNormStats | tuple[int, float, float] | None = None
    last_state: tuple[str, int] | None = None  # (folder, step) of the last training state written

    def state_dict(self) -> dict:
        """Every field, JSON-ready (a training state's ``state.json`` holds these keys; the
        position as its ``epoch`` / ``batch``). The max-norm statistics are read to the host."""
        # lazy: the record is made before torch is imported (the statistics' module imports it)
        from library.training.network_options import host_stats

        epoch, batch = self.position
        stats = None if self.max_norm_stats is None else list(host_stats(self.max_norm_stats))
        return {"global_step": self.global_step, "epoch": epoch, "batch": batch,
                "epochs_done": self.epochs_done, "samples_seen": self.samples_seen,
                "loss_log": list(self.loss_log), "lr_log": list(self.lr_log),
                "val_log": [list(v) for v in self.val_log], "max_norm_stats": stats,
                "last_state": None if self.last_state is None else list(self.last_state)}

    @classmethod
    def from_state(cls, d: dict) -> "Progress":
        """The record ``state_dict`` wrote (a state written before ``val_log``,
        ``max_norm_stats`` and ``last_state`` were saved restores them empty)."""
        stats, last = d.get("max_norm_stats"), d.get("last_state")
        return cls(global_step=int(d["global_step"]), epochs_done=int(d["epochs_done"]),
                   samples_seen=int(d["samples_seen"]), position=(int(d["epoch"]), int(d["batch"])),
                   loss_log=list(d["loss_log"]), lr_log=list(d["lr_log"]),
                   val_log=[(int(s), v) for s, v in d.get("val_log", [])],
                   max_norm_stats=None if stats is None else (int(stats[0]), stats[1], stats[2]),
                   last_state=None if last is None else (last[0], int(last[1])))
