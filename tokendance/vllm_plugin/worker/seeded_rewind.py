"""Seeded requests on vLLM-CPU: the rewind of a discarded sample, which stops vLLM 0.32's engine.

vLLM samples a token for every request of a step, also for a prompt computed in chunks, whose
every chunk but the last samples a token nobody keeps. For a seeded request it then rewinds the
request's generator (`gpu_model_runner._bookkeeping_sync`: `gen.set_offset(gen.get_offset() - 4)`),
so that the request samples the same tokens however its prompt was chunked. That is Philox's
offset on CUDA; a CPU generator (a Mersenne Twister) has none, so `RuntimeError: CPU Generator does
not use offset` escapes the step and stops the engine: any seeded request whose prompt is longer
than a step's token budget, or that shares a step with others, kills plain vLLM-CPU too.

Installed by the general plugin (`tokendance.vllm_plugin.register`) in every vLLM process: a
seeded request's CPU generator becomes a `RewindableGenerator` when it joins the input batch, the
sampler keeps each such generator's state before it samples, and vLLM's rewind restores it. The
rewind then does on CPU what it does on GPUs; nothing else changes.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("tokendance.vllm")


@functools.cache
def rewindable_generator() -> type:
    """The `torch.Generator` subclass whose offset vLLM's rewind can move (made once: torch is
    imported only here, in vLLM's processes)."""
    import torch

    class RewindableGenerator(torch.Generator):
        """A CPU generator that keeps its state before each sampling step (`keep`): its offset
        reads 0, and setting one restores the kept state (undoes the step's draws)."""

        kept = None

        def keep(self) -> None:
            try:
                self.kept = self.get_state()
            except Exception:  # then no rewind (vLLM's own outcome on CPU), never a stopped step
                self.kept = None

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int):
            if self.kept is not None:
                self.set_state(self.kept)
            return self

    return RewindableGenerator


def rewindable(generator):
    """`generator` as a `RewindableGenerator` with the same state (a CPU one that is not yet), else
    itself."""
    cls = rewindable_generator()
    if generator is None or isinstance(generator, cls) or generator.device.type != "cpu":
        return generator
    try:
        fresh = cls(device="cpu")
        fresh.set_state(generator.get_state())
    except Exception:  # never the request's end: it keeps vLLM's own generator (and vLLM's rewind)
        logger.exception("TokenDance: a seeded request's generator could not be made rewindable")
        return generator
    return fresh


def install() -> None:
    """Wrap the input batch's `add_request` (a seeded request's CPU generator made rewindable, for
    the batch and for the request's state, which re-adds it after a preemption) and the sampler's
    `forward` (each rewindable generator keeps its state first). Safe to call twice. A vLLM
    without them is left as it is (logged)."""
    try:
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker.gpu_input_batch import InputBatch

        add_request, forward = InputBatch.__dict__["add_request"], Sampler.__dict__["forward"]
    except (ImportError, KeyError) as exc:
        logger.warning("TokenDance: seeded requests keep vLLM's own rewind (%s: %s)", type(exc).__name__, exc)
        return
    if not getattr(add_request, "_tokendance_rewind", False):
        @functools.wraps(add_request)
        def add(self, request, *args, **kwargs):
            request.generator = rewindable(request.generator)
            return add_request(self, request, *args, **kwargs)

        add._tokendance_rewind = True
        InputBatch.add_request = add

    if not getattr(forward, "_tokendance_rewind", False):
        cls = rewindable_generator()

        @functools.wraps(forward)
        def sample(self, logits, sampling_metadata, *args, **kwargs):
            for generator in sampling_metadata.generators.values():
                if isinstance(generator, cls):
                    generator.keep()
            return forward(self, logits, sampling_metadata, *args, **kwargs)

        sample._tokendance_rewind = True
        Sampler.forward = sample
