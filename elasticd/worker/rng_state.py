"""The process's random generators as one entry of a training state (:class:`RNGState`), so
that a restore resumes the same random streams. Worker side: imports torch."""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


class RNGState:
    """The process's random generators as one stateful entry: put ``RNGState()`` in the state.

    Covers torch's CPU generator, numpy's global (legacy) generator, python's ``random`` and,
    when CUDA is initialised, every CUDA device's generator. Loaders with their own
    ``torch.Generator`` must snapshot it themselves (docs/facts.md: exact resume needs it).
    """

    def state_dict(self) -> dict[str, Any]:
        kind, key, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "key": key, "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            # 625 words as one int64 tensor rather than 625 JSON numbers in the header.
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        np.random.set_state((n["kind"], n["key"], n["pos"], n["has_gauss"], n["cached_gaussian"]))
        p = state["python"]
        random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
