"""Which TorchTrainer an attempt runs: petatrain's lean one (runtime._ray.trainer), or Ray's stock one."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def trainer_class(local: bool = False, controller: str = "driver") -> type:
    """petatrain's lean TorchTrainer for a local Ray (`local`) and a controller in the driver or an
    actor (`constants.controller_mode()`), or the stock one if Ray's internals moved."""
    try:
        from petatrain.runtime._ray.trainer import trainer_class as lean
    except (ImportError, AttributeError):
        log.warning("Ray's internals moved (tests/test_ray_internals.py says which): using the stock TorchTrainer")
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    return lean(local, controller)
