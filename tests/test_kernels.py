"""The paged decode kernel (keys read in place, queries rotated, shared runs read once) against
the eager path (gather, rotate keys, SDPA), on real rounds whose agents read shared masters at
other positions. Skipped where no C compiler builds it."""

from __future__ import annotations

import pytest

from tests.test_model_reference import LOGIT_ATOL
from tests.test_rounds import round_turns
from tokendance import SamplingParams
from tokendance.model import kernels

PARAMS = SamplingParams(temperature=0, max_tokens=12, return_logits=True)  # every decode step's logits


@pytest.fixture
def kernel_enabled(monkeypatch):
    monkeypatch.setenv("TOKENDANCE_KERNELS", "1")
    kernels.load.cache_clear()
    if kernels.load() is None:
        pytest.skip("the paged decode kernel could not be built here (no C compiler?)")
    yield
    kernels.load.cache_clear()


@pytest.mark.parametrize("mode", ["prefix", "tokendance"])
def test_kernel_decode_equals_eager_decode(make_llm, kernel_enabled, mode):
    fast = make_llm(dtype="float32", reuse=mode, recompute_ratio=0.3)
    assert fast.engine.runner.model.decode_kernel is not None
    kernels.load.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENDANCE_KERNELS", "0")
        eager = make_llm(dtype="float32", reuse=mode, recompute_ratio=0.3)
    assert eager.engine.runner.model.decode_kernel is None
    for rounds in (1, 2):  # round 2: sessions, recall and masters at other positions
        got = fast.run_round(round_turns(rounds), PARAMS)
        want = eager.run_round(round_turns(rounds), PARAMS)
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        for ours, ref in zip(got.outputs, want.outputs):
            assert len(ours.logits) == len(ref.logits) > 1
            for a, b in zip(ours.logits, ref.logits):
                assert (a - b).abs().max().item() < LOGIT_ATOL


def test_the_kernel_takes_only_shapes_its_buffers_hold():
    """Llama-2-7B's 32 KV heads do not fit the kernel's buffers: such a model decodes in torch
    ops instead of failing at every step."""
    from tokendance.model import kernels

    assert kernels.supports(3, 9, 64)  # the default model
    assert not kernels.supports(32, 32, 128)  # Llama-2-7B
    assert not kernels.supports(8, 8 * 17, 64) and not kernels.supports(8, 8, 512)
