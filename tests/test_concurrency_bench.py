"""benchmarks/concurrency.py on a tiny attention shape: the sequences it counts
are what the store's sizing and the scheduler's rule allow, and the fp16
count is what mlx-lm's KVCache bytes allow (CPU, no timing)."""

from __future__ import annotations

import pytest

from benchmarks.concurrency import (
    RESERVE_TOKENS as RESERVE,
    admitted_by_counts,
    fitted_slots,
    planned_blocks,
    probe_store,
    run_fp16,
    run_kiviq,
)
from kiviq.engine.kv_store import KVConfig

SHAPE = (2, 2, 32, 4, 1024)  # layers, kv heads, head_dim, query heads, model context
G, R, CONTEXT = 16, 32, 200
BUDGET = 1 << 20


def quiet(_msg: str) -> None:
    pass


@pytest.mark.parametrize("bits", [2, 4])
def test_kiviq_count_is_what_the_budget_allows(bits):
    probe = probe_store(*SHAPE[:3], KVConfig(bits, G, R))
    need, need_reserved = probe.blocks_needed(CONTEXT), probe.blocks_needed(CONTEXT + RESERVE)
    assert (need, need_reserved) == ((CONTEXT - R) // G, (CONTEXT + RESERVE - R) // G)
    per_seq = need * probe.block_bytes + probe.slot_bytes
    ms, n = fitted_slots(probe, BUDGET, CONTEXT, SHAPE[-1])
    r = run_kiviq(SHAPE, bits, BUDGET, CONTEXT, ms, "fit", group_size=G, residual=R, log=quiet)
    # make_store's sizing, then every sequence holds `need` blocks and the last
    # admitted one also found room for the reserve.
    blocks = (BUDGET - ms * probe.slot_bytes) // probe.block_bytes
    assert r.num_blocks == blocks == planned_blocks(probe, BUDGET, ms, SHAPE[-1])
    assert r.held == n == min(ms, (blocks - need_reserved) // need + 1)
    assert r.bytes_per_seq == per_seq and r.blocks_per_seq == need
    assert BUDGET // per_seq - 1 <= r.held <= BUDGET // per_seq
    # Really allocated, and within the budget.
    assert r.store_bytes <= BUDGET
    assert r.store_bytes <= r.active_before_fill <= BUDGET
    # One slot fewer holds one sequence fewer, refused for want of a slot.
    fewer = run_kiviq(SHAPE, bits, BUDGET, CONTEXT, ms - 1, "", group_size=G, residual=R, log=quiet)
    assert fewer.held == ms - 1 == admitted_by_counts(probe, planned_blocks(probe, BUDGET, ms - 1, SHAPE[-1]),
                                                      ms - 1, CONTEXT)
    assert fewer.refusal == "no free slot"


def test_fp16_count_is_budget_over_kvcache_bytes():
    r = run_fp16(SHAPE, BUDGET, CONTEXT, chunk=64, log=quiet)
    # mlx-lm's KVCache grows in steps of 256 tokens: 200 tokens hold 256.
    assert r.bytes_per_seq == 2 * 2 * 2 * 256 * 32 * 2
    assert r.held == BUDGET // r.bytes_per_seq
    assert r.cache_bytes == r.held * r.bytes_per_seq <= r.active_bytes
