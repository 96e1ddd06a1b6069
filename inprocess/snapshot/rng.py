"""``RNGState``: the random number generators as a state entry (opt-in).

Not captured unless asked: many jobs seed each rank differently, which would
make replicated state differ from rank to rank. Add it to the state to make a
restored run draw the same random numbers as a run without the fault::

    state = {"model": model, "optim": opt, "rng": inprocess.snapshot.RNGState()}

With ``restore(state)`` (replicated) every rank must then draw the same
numbers (same seed); per-rank generators belong in ``replicated=False`` state.
"""

from __future__ import annotations

import random
from typing import Any

import torch


class RNGState:
    """torch's CPU (and, where present, CUDA) generators, Python's and NumPy's."""

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            out["numpy"] = np.random.get_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
