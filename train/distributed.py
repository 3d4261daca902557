"""A multi-host run's start: ``jax.distributed.initialize`` from the run's flags, waiting for
the coordinator with one line of error instead of jax's abort."""

from __future__ import annotations

import jax

from shardzoo.errors import EnvironmentFault
from shardzoo.train.config import ConfigError, TrainConfig


def init_distributed(cfg: TrainConfig) -> None:
    """``jax.distributed.initialize`` from the multi-host flags; call before touching devices."""
    explicit = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    timeouts = dict(initialization_timeout=cfg.distributed_timeout,
                    heartbeat_timeout_seconds=cfg.heartbeat_timeout)
    if any(v is not None for v in explicit):
        if None in explicit:
            raise ConfigError("--coordinator, --num-processes and --process-id go together")
        if cfg.process_id != 0:  # process 0 starts the coordinator; the others must reach it
            _wait_for_coordinator(cfg.coordinator, cfg.distributed_timeout)
        jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id, **timeouts)
    elif cfg.distributed:
        jax.distributed.initialize(**timeouts)


def _wait_for_coordinator(address: str, timeout: float) -> None:
    """Connect to the coordinator until it answers, or raise one line after ``timeout`` seconds
    (jax's client would abort the process with SIGABRT instead)."""
    import socket
    import time

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise EnvironmentFault(
                    f"--coordinator {address}: no answer within --distributed-timeout {timeout:g} s "
                    f"({e.strerror or e}); start process 0 there first, or check the address") from None
            time.sleep(0.5)
