"""This process's random generators (torch, CUDA, Python, NumPy) as tensors, and back (internal)."""

from __future__ import annotations

import random
from collections.abc import Mapping

import torch

from replicator.checkpoint.layout import Layout

__all__: list[str] = []


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's torch, CUDA, Python and NumPy generator states, all as tensors."""
    import numpy as np

    version, mt, gauss = random.getstate()
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # legacy=True: (name, keys, position, has_gauss, gauss)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = legacy
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_extra": torch.tensor([float(np_pos), float(np_has_gauss), float(np_gauss)], dtype=torch.float64),
    }
    if np_name != "MT19937":
        del state["numpy"], state["numpy_extra"]
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{index}"] = cuda_state
    return state


def set_rng(state: Mapping[str, torch.Tensor]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    python = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((int(python[0]), tuple(int(v) for v in python[1:]), gauss if has_gauss else None))
    if "numpy" in state:
        pos, np_has_gauss, np_gauss = state["numpy_extra"].tolist()
        keys = state["numpy"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(pos), int(np_has_gauss), np_gauss))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if f"cuda{index}" in state:
                torch.cuda.set_rng_state(state[f"cuda{index}"], index)


def fresh_seed(step: int, layout: Layout) -> None:
    """Distinct, reproducible streams for a process that had none in the checkpoint."""
    import numpy as np

    seed = (step * 1_000_003 + layout.replica * 1_009 + layout.stage) % (2**63)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))

