"""The roofline account: its arithmetic on hand-made batches, the peaks' cache, and a round's
account against the round's own counts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import round_turns
from tokendance import SamplingParams
from tokendance.batch import ScheduledRequest
from tokendance.config import ModelConfig
from tokendance.model.roofline import Account, ModelShape, Peaks, items_work, machine_peaks

CONFIG = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5, max_model_len=512, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_ids=(0,))
PEAKS = Peaks("bfloat16", 2, gemm_flops=1e12, bandwidth=1e10)


def item(positions, context: int, sample: bool) -> ScheduledRequest:
    return ScheduledRequest("r", [1] * len(positions), positions, list(range(context)), sample, None)


def test_shape_counts_every_linear_weight():
    shape = ModelShape.of(CONFIG, torch.bfloat16)
    # q, o: 64x64; k, v: 64x32; gate, up, down: 64x128
    assert shape.layer_params == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert shape.head_params == 64 * 1000 and shape.query_width == 64
    assert shape.kv_row_bytes == 2 * 32 * 2 and shape.element_bytes == 2


def test_work_of_a_prefill_chunk_a_decode_and_a_partial_pass():
    shape = ModelShape.of(CONFIG, torch.float32)
    chunk = items_work([item(range(10, 14), 14, sample=True)], shape)  # positions 10..13 attend 11..14 keys
    assert chunk.rows == 4
    assert chunk.linear_flops == 2 * 4 * shape.layer_params * 4 + 2 * 1 * shape.head_params
    assert chunk.attention_flops == 4 * (11 + 12 + 13 + 14) * 64 * 4
    assert chunk.kv_bytes == (14 + 4) * shape.kv_row_bytes * 4
    decode = items_work([item([99], 100, sample=True)], shape)
    assert decode.attention_flops == 4 * 100 * 64 * 4
    partial = items_work([item(range(5), 5, sample=True)], shape, num_layers=1)  # no LM head on a partial pass
    assert partial.linear_flops == 2 * 5 * shape.layer_params * 1


def test_a_forward_reads_its_weights_once_and_splits_its_time_by_roofline():
    shape = ModelShape.of(CONFIG, torch.float32)
    account = Account()
    before = account.snapshot()
    prepare = items_work([item(range(100), 100, sample=False)], shape)
    decode = items_work([item([49], 50, sample=True), item([59], 60, sample=True)], shape)
    account.record({"prepare": prepare, "decode": decode, "prefill": items_work([], shape)}, shape, None, 2.0, PEAKS)
    window = account.since(before)
    weights = (shape.layer_params * 4 + shape.head_params) * 4
    assert window.kinds["prepare"].weight_bytes + window.kinds["decode"].weight_bytes == pytest.approx(weights)
    assert window.kinds["decode"].weight_bytes == pytest.approx(weights * 2 / 102)
    assert window.total().seconds == pytest.approx(2.0) and window.forwards == 1
    roofs = {k: window.kinds[k].roofline_seconds(PEAKS) for k in ("prepare", "decode")}
    assert window.kinds["prepare"].seconds / window.kinds["decode"].seconds == pytest.approx(roofs["prepare"] / roofs["decode"])
    assert account.since(account.snapshot()).total().rows == 0


def test_peaks_are_measured_once_then_read_from_the_cache(tmp_path):
    first = machine_peaks(torch.float32, "test cpu", tmp_path)
    assert first.gemm_flops > 1e9 and first.bandwidth > 1e8  # any machine of this kind does more
    assert machine_peaks(torch.float32, "test cpu", tmp_path) == first
    assert (tmp_path / "peaks.json").exists()


def test_a_rounds_account_matches_its_counts(make_llm):
    llm = make_llm(reuse="tokendance", recompute_ratio=0.3, selection="cacheblend")  # with its check pass
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.run_round(round_turns(1), params)
    result = llm.run_round(round_turns(2), params)
    stats, kinds = result.stats, result.stats.work.kinds
    cost = stats.cost
    assert kinds["prepare"].rows == cost.new_shared + cost.shared_again + cost.private + cost.recomputed
    check_layers = llm.engine.config.check_layer + 1  # the check pass runs through the check layer
    assert kinds["check"].rows > 0
    assert kinds["check"].linear_flops == kinds["check"].rows * 2 * llm.engine.shape.layer_params * check_layers
    # the scheduler's rows: each agent's last prompt token, then one per generated token but the last
    assert kinds["decode"].rows + kinds["prefill"].rows == sum(o.num_generated_tokens for o in result.outputs)
    assert 0 < stats.roofline_seconds < stats.round_seconds and 0 < stats.efficiency < 1
    parts = stats.forward_seconds + stats.sampling_seconds + stats.other_seconds
    assert parts == pytest.approx(stats.round_seconds, rel=0.05)
