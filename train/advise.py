"""``shardzoo advise``'s model side: one trace of the train state, the model's variants and
costs, and ``--verify`` (the Program's real step compiled for the top candidates).

The ranking itself is ``sharding/advise.py``'s. Here a ``Program`` traces the train state once
(on a one-device abstract mesh; its params, optimizer state and activation constraints are
re-validated per candidate), and the model tells its costs: training FLOPs per token
(``flops_per_token``), its activation estimate per remat policy (through the plan), and the
FLOPs each policy recomputes per token (forward FLOPs are a third of training FLOPs; ``A`` the
attention part, the FLOPs that grow with the sequence):

    none, dots_saveable                 0 (they keep every matmul's output)
    dots_with_no_batch_dims_saveable    A / 3 (attention's batched matmuls are recomputed)
    save_qkv_mlp                        A / 3 (keeps q, k, v and the MLP's gate and up: only
                                        attention and elementwise work are recomputed)
    save_qkv                            A / 3 + 0.55 (F - A) / 3: save_qkv_mlp's and the MLP's
                                        gate and up (0.55 of a Llama layer's matmuls)
    save_attn_mlp                       A / 3 + 0.65 (F - A) / 3: every projection but the
                                        attention output and the MLP down projection, whose
                                        inputs it keeps (0.65 of a Llama layer's matmuls)
    full                                F / 3 (the whole forward)

A ``--override remat_policy=...`` keeps that one policy.
"""

from __future__ import annotations

import math
import re

from shardzoo.models.layers import fuses
from shardzoo.sharding.advise import KINDS, Advice, AdviseError, Variant, advise, get_device
from shardzoo.sharding.mesh import make_abstract_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train import model_info
from shardzoo.train.defaults import default_seq_len
from shardzoo.train.program import Program

DEFAULT_TABLES = ("dp", "fsdp", "tp", "fsdp_tp", "sp", "ep", "cp", "cp_fsdp", "pp")
_SAVE_ATTN_MLP_SHARE = 0.65
_SAVE_QKV_SHARE = 0.55


def default_tables() -> list[str]:
    """Every parameter-placement preset there is (``zero1`` is an optimizer-state table)."""
    from shardzoo.sharding.rules import PRESETS

    return [t for t in DEFAULT_TABLES if t in PRESETS]


def variants(config, seq_len, pinned: bool) -> list[Variant]:
    """The model's remat policies with the FLOPs each recomputes (module docstring)."""
    if not config.remat_policies:
        return [Variant("-", config, 0.0)]
    flops = config.flops_per_token(seq_len)
    attention = max(flops - config.flops_per_token(1), 0.0)
    recompute = {
        "none": 0.0, "dots_saveable": 0.0, "dots_with_no_batch_dims_saveable": attention / 3,
        "save_qkv_mlp": attention / 3,
        "save_qkv": attention / 3 + _SAVE_QKV_SHARE * (flops - attention) / 3,
        "save_attn_mlp": attention / 3 + _SAVE_ATTN_MLP_SHARE * (flops - attention) / 3,
        "full": flops / 3,
    }
    policies = [config.execution.remat_policy] if pinned else list(config.remat_policies)
    return [Variant(p, config.replace(remat_policy=p), recompute.get(p, flops / 3))
            for p in policies]


def advise_model(config, *, name: str, num_devices: int, device_memory: str,
                 devices_per_host: int | None = None, batch_size: int | None = None,
                 seq_len: int | None = None, candidates=None, headroom: float = 0.1,
                 pinned_remat: bool = False, optimizer=None) -> Advice:
    """Rank candidate rule tables and meshes for ``config`` on ``num_devices`` devices."""
    device = get_device(device_memory, devices_per_host)
    if num_devices < 1:
        raise AdviseError(f"--devices {num_devices}: need at least one device")
    tables = [get_rules(c) for c in (candidates or default_tables())]
    batch = num_devices if batch_size is None else batch_size
    if batch < 1 or (seq_len is not None and seq_len < 1):
        raise AdviseError("--batch-size and --seq-len must be positive")
    lm = model_info.task(config) == "lm"
    if lm and seq_len is None:
        seq_len = default_seq_len(config)
    if optimizer is None:
        from shardzoo.train.program import default_optimizer

        optimizer = default_optimizer()
    program = Program(config, get_rules("dp"), make_abstract_mesh("data=1"), optimizer=optimizer,
                      batch_size=batch, seq_len=seq_len or 1)
    flops = config.flops_per_token(seq_len) if lm else config.flops_per_token()
    return advise(
        program.boxed_params, program.boxed_opt_state, program.activation_sites,
        variants(config, seq_len, pinned_remat), tables=tables, num_devices=num_devices,
        device=device, batch_size=batch, seq_len=seq_len if lm else None, flops_per_token=flops,
        headroom=headroom, fused=hasattr(config.execution, "fuse_projections") and fuses(config.execution), name=name,
    )


# ------------------------------------------------------------------ the compiled step's bytes
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_HEAD = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_CALLS = re.compile(r"(?:true_computation|false_computation|calls|branch_computations=\{[^}]*)=%?([\w.\-]+)")


def _shape_bytes(text: str) -> list[int]:
    return [_DTYPE_BYTES[t] * math.prod(int(x) for x in d.split(",") if x) for t, d in _SHAPE.findall(text)]


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in (p.split("=") for p in m.group(1).split(","))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]+)\}", line)
    return len(m.group(1).split(",")) if m else 1


def hlo_collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per step of each collective kind in a compiled module's text, per device.

    A collective's bytes are its whole buffer over its group, as the advisor counts them: an
    all-gather's result, an all-reduce's, all-to-all's or permute's operand (their results
    have the operands' shapes), a reduce-scatter's operand (result x group). A collective in a
    ``while`` body counts once per iteration (XLA's ``known_trip_count``).
    """
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        m = _HEAD.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    out = dict.fromkeys(KINDS, 0)
    todo = [(entry, 1)] if entry else []
    while todo:
        comp, repeat = todo.pop()
        for line in comps.get(comp, ()):
            loop = re.search(r" while\(.*?body=%?([\w.\-]+)", line)
            if loop:
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                todo.append((loop.group(1), repeat * (int(n.group(1)) if n else 1)))
                continue
            if " fusion(" not in line:
                todo += [(c, repeat) for c in _CALLS.findall(line) if c in comps]
            m = _OP.match(line)
            if not m:
                continue
            kind, start, result = m.group(2), m.group(3), m.group(1)
            sizes = _shape_bytes(result)
            if start and result.startswith("(") and kind != "all-reduce":
                sizes = sizes[len(sizes) // 2:]  # (operands, results) of an async start
            nbytes = sum(sizes) * (_group_size(line) if kind == "reduce-scatter" else 1)
            out[kind] += nbytes * repeat
    return out


# ------------------------------------------------------------------ --verify
def verify(advice: Advice, config, top: int, *, optimizer_name: str = "adamw") -> list[dict]:
    """Compile the Program's real train step for the top candidates (when this machine has
    exactly their device count, e.g. fake CPU devices) and report XLA's memory, collective
    counts and bytes beside the estimates."""
    import jax

    from shardzoo.sharding.mesh import make_mesh
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    out = []
    for c in advice.ranked[:top]:
        entry = {"rules": c.rules, "mesh": c.mesh_text, "remat": c.variant, "grad_accum": c.grad_accum}
        if jax.device_count() != advice.num_devices:
            entry["skipped"] = (f"needs {advice.num_devices} devices, this machine has "
                                f"{jax.device_count()} (fake CPU devices: XLA_FLAGS="
                                f"--xla_force_host_platform_device_count={advice.num_devices})")
            out.append(entry)
            continue
        variant = config
        if config.remat_policies and c.variant != "-":
            variant = config.replace(remat_policy=c.variant)
        settings = TrainConfig(batch_size=advice.batch_size, seq_len=advice.seq_len or 1,
                               grad_accum=c.grad_accum, optimizer=optimizer_name)
        program = run_program(settings, variant, advice.tables[c.rules], make_mesh(c.mesh))
        report = program.compile_report()
        entry.update(memory=report["memory"], collectives=report["collectives"],
                     collective_bytes=hlo_collective_bytes(program.compiled_train_step().as_text()),
                     estimate_total=c.memory["total"], estimate_bytes=c.collective_bytes)
        out.append(entry)
    advice.verify = out
    return out


def format_verify(entries: list[dict]) -> str:
    """XLA's figures beside the estimates, one block per candidate."""
    from shardzoo.sharding.plan import format_bytes

    lines = ["--verify: the compiled train step (XLA, per device) beside the estimate"]
    for i, e in enumerate(entries, 1):
        head = f"  #{i} {e['rules']} {e['mesh']} (remat {e['remat']}, accum {e['grad_accum']})"
        if "skipped" in e:
            lines.append(f"{head}: skipped, {e['skipped']}")
            continue
        mem = e["memory"].get("total")
        lines.append(f"{head}: memory {format_bytes(mem)} (estimate {format_bytes(e['estimate_total'])})")
        xla, est = e["collective_bytes"], e["estimate_bytes"]
        parts = []
        for kind in KINDS:
            if xla[kind] or est[kind] or e["collectives"][kind]:
                parts.append(f"{kind} {e['collectives'][kind]} ops {format_bytes(xla[kind])} "
                             f"(estimate {format_bytes(est[kind])})")
        lines.append("     " + "; ".join(parts or ["no collectives"]))
    return "\n".join(lines)
