"""A job's progress, folded from its progress stream (library/outputs/progress_stream.py).

    ProgressReader(path).update() -> self    reads the lines appended since the last call
    .summary(output_dir) -> {"step", "total_steps", "epoch", "loss", "lr", "eta_s", "outputs",
                             "samples", "sample_steps", "val_loss", "grad_norm"}
"""
from __future__ import annotations

import json
import os

ETA_WINDOW = 20  # steps whose pace estimates the time left


class ProgressReader:
    def __init__(self, path: str):
        self.path = path
        self._reset()

    def _reset(self) -> None:
        """Nothing read yet (a new file at the path starts over)."""
        self._offset = 0
        self.plan: dict | None = None
        self.last_step: dict | None = None
        self.step_times: list[tuple[int, float]] = []
        self.val: list[dict] = []
        self.saves: list[str] = []
        self.samples: list[dict] = []
        self.end: dict | None = None

    def update(self) -> "ProgressReader":
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return self
        if size < self._offset:  # a new file
            self._reset()
        if size == self._offset:
            return self
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                self.fold(json.loads(line))
            except (ValueError, AttributeError):
                continue
        return self

    def fold(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "plan":
            self.plan, self.end = ev, None
            self.step_times = []  # a resumed run: its own pace
        elif kind == "step":
            self.last_step = ev
            self.step_times = (self.step_times + [(ev["step"], ev["time"])])[-ETA_WINDOW:]
        elif kind == "validation":
            self.val.append({"step": ev["step"], "loss": ev["loss"]})
        elif kind == "save":
            if ev["file"] not in self.saves:
                self.saves.append(ev["file"])
        elif kind == "samples":
            self.samples.append({"step": ev["step"], "files": ev["files"]})
        elif kind == "end":
            self.end = ev

    def eta_s(self) -> float | None:
        if self.plan is None or len(self.step_times) < 2 or self.end is not None:
            return None
        (s0, t0), (s1, t1) = self.step_times[0], self.step_times[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * max(0, self.plan["total_steps"] - s1)

    def summary(self, output_dir: str | None) -> dict:
        def rel(p):
            if output_dir:
                r = os.path.relpath(os.path.abspath(p), os.path.abspath(output_dir))
                if not r.startswith(".."):
                    return r
            return os.path.basename(p)

        s = self.last_step or {}
        sample_steps = [{"step": x["step"], "files": [rel(f) for f in x["files"]]} for x in self.samples]
        return {"step": s.get("step", 0), "total_steps": (self.plan or {}).get("total_steps"),
                "epoch": s.get("epoch"), "loss": s.get("loss"), "lr": s.get("lr"),
                "grad_norm": s.get("grad_norm"), "eta_s": self.eta_s(),
                "val_loss": self.val[-1]["loss"] if self.val else None,
                "outputs": [rel(p) for p in self.saves],
                "samples": [f for x in sample_steps for f in x["files"]],
                "sample_steps": sample_steps}
