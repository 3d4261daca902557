"""Distillation's teacher on the student's ``Program``: a second, frozen model (any family with
the student's vocabulary) built on the student program's placement, its abstract params and
shardings from one trace of its init under the same rules, its compiled step and, for
``--seq-kd``, a params-only program that samples with it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.sharding.partition import activate
from shardzoo.sharding.validate import check
from shardzoo.train import model_info
from shardzoo.train.jit import per_device_bytes, with_shardings
from shardzoo.train.step import teacher_step


class Teacher:
    """``program.teacher``: the teacher ``config`` (its vocabulary padded as the student's),
    ``module``, ``target`` (its params as ShapeDtypeStructs with their ``shardings``: the
    restore target), ``compiled_step`` and ``sampler``."""

    def __init__(self, program, config, strict: bool):
        self._student = program
        self.config = model_info.with_vocab_of(program.config, config)
        self.module = self.config.build(program.placement)
        inputs = [jnp.zeros(s.shape, s.dtype) for s in self.config.sample_inputs(program.micro_batch, program.seq_len)]

        def init(rng):
            return self.module.init({"params": rng}, *inputs, deterministic=True)["params"]

        with activate(program.mesh):
            boxed = jax.eval_shape(init, jax.random.key(0))
        report = check({"teacher": boxed}, program.rules, program.mesh, strict=strict)  # its paths: teacher/...
        self.shardings = report.shardings(program.mesh)["teacher"]
        self.target = with_shardings(nn.meta.unbox(boxed), self.shardings)
        self._step = self._sampler = None

    def compiled_step(self):
        """The compiled teacher step: ``(teacher_params, batch) -> {teacher_logits}``, the batch
        without its later entries; the params placed as ``target``."""
        if self._step is None:
            p = self._student
            fn = functools.partial(teacher_step, module=self.module, task=p.task)
            self._step = p.compile_filler(fn, ("teacher_logits",), params=self.target, params_shardings=self.shardings)
        return self._step

    def sampler(self):
        """The teacher as a params-only Program on the run's rules and mesh (``--seq-kd`` samples with it)."""
        if self._sampler is None:
            p = self._student
            self._sampler = type(p)(self.config, p.rules, p.mesh, batch_size=p.batch_size, seq_len=p.seq_len)
        return self._sampler

    def param_bytes(self) -> int:
        """The frozen params' bytes on one device (the plan's reference)."""
        return per_device_bytes(self.target, self.shardings)
