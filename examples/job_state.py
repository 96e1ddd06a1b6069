"""What ``train.py`` and ``train_plain.py`` share: the event log and the checkpoint.

Both write one JSON line per event to ``<result dir>/events.jsonl`` (read by the
demo, the tests and the benchmarks) and keep ``(step, w)`` in
``<result dir>/checkpoint.json``, replaced atomically.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class JobState:
    def __init__(self, result_dir: Path, rank: int, incarnation: int) -> None:
        result_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint = result_dir / "checkpoint.json"
        self.events = result_dir / "events.jsonl"
        self.rank = rank
        self.incarnation = incarnation

    def record(self, kind: str, **data: object) -> None:
        line = json.dumps(
            {
                "kind": kind,
                "rank": self.rank,
                "incarnation": self.incarnation,
                "time": time.time(),
                **data,
            }
        )
        with open(self.events, "a") as f:  # short appends of whole lines: safe across processes
            f.write(line + "\n")

    def load_checkpoint(self) -> tuple[int, float]:
        try:
            data = json.loads(self.checkpoint.read_text())
            return data["step"], data["w"]
        except FileNotFoundError:
            return 0, 0.0

    def save_checkpoint(self, step: int, w: float) -> None:
        tmp = self.checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "w": w}))
        os.replace(tmp, self.checkpoint)
