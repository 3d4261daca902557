"""Named sets of XLA flags, put into ``XLA_FLAGS`` before JAX starts its backends.

XLA reads ``XLA_FLAGS`` once, when the first backend is created; later changes are ignored, and
a flag this XLA does not know aborts the process. So a preset is applied by the launcher before
anything touches a device, and every flag of every preset is checked against this jaxlib's XLA
by the tests (on CPU: XLA parses the GPU flags too).

``gpu-overlap`` turns on communication/compute overlap for data-, FSDP- and tensor-parallel
training on GPUs, as NVIDIA's JAX-Toolbox and MaxText's GPU recipes do: the latency-hiding
scheduler (reorders async collectives around compute), a high-priority stream for them,
pipelined all-gather / reduce-scatter / all-reduce across the layer scan (FSDP: the next layer's
weights are gathered while this layer computes), double-buffered while loops, and combine
thresholds that batch small collectives into large ones.
"""

from __future__ import annotations

import os
import shlex

from shardzoo.errors import UserError

_GIB = 1 << 30
XLA_PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "gpu-overlap": (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        f"--xla_gpu_all_reduce_combine_threshold_bytes={_GIB}",
        f"--xla_gpu_all_gather_combine_threshold_bytes={_GIB // 8}",
        f"--xla_gpu_reduce_scatter_combine_threshold_bytes={_GIB // 16}",
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    ),
}
XLA_PRESET_HELP = {
    "none": "no flags added (XLA's defaults, or whatever XLA_FLAGS already holds)",
    "gpu-overlap": "GPUs: latency-hiding scheduler, pipelined async collectives, combine thresholds",
}


class XlaPresetError(UserError):
    """An XLA flag preset that does not exist or comes too late."""


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged_flags(preset: str, current: str = "") -> str:
    """``current`` XLA_FLAGS plus the preset's flags; a flag ``current`` sets keeps its value."""
    if preset not in XLA_PRESETS:
        raise XlaPresetError(f"--xla-preset {preset!r} is unknown; presets: {', '.join(XLA_PRESETS)}")
    own = shlex.split(current or "")
    given = {_name(f) for f in own}
    return " ".join([f for f in XLA_PRESETS[preset] if _name(f) not in given] + own)


def apply_xla_preset(preset: str | None, environ=os.environ) -> str:
    """Put the preset into ``environ["XLA_FLAGS"]`` (before JAX's backends exist); the flags."""
    current = environ.get("XLA_FLAGS", "")
    if not preset:
        return current
    flags = merged_flags(preset, current)
    if flags != current:
        from jax._src import xla_bridge  # no public query for "has XLA read its flags yet"

        if xla_bridge.backends_are_initialized():
            raise XlaPresetError(
                f"--xla-preset {preset}: JAX has already started, so XLA would ignore the flags; "
                "pass it to a fresh process (or set XLA_FLAGS before starting Python)")
        environ["XLA_FLAGS"] = flags
    return flags
