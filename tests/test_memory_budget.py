"""The memory budget (``hf2q_py/budget.py``): its numbers on tiny models,
admission under it (waiting in order, max_tokens cut to what fits, refusals
with the numbers), the prompt cache evicted by bytes, MLX's peak memory of a
batched run within it, MLX's buffer cache given back, allocation failures."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from models import random_prompt, tiny_target

from hf2q_py.batch.cache import STEP
from hf2q_py.batch.runtime import BatchRuntime
from hf2q_py.budget import (
    MemoryBudget,
    MemoryExhausted,
    MemoryLedger,
    MemoryRefused,
    allocation_failure,
    arrays_bytes,
    model_bytes,
    parse_size,
)
from hf2q_py.errors import Hf2qError
from hf2q_py.generation import batch_generate, make_config
from hf2q_py.kv import FULL_PRECISION, KVConfig, kv_bytes_per_token, kv_footprint
from hf2q_py.prompt_cache import PromptCache
from hf2q_py.scheduler import Scheduler, SchedulerConfig, Sink

#: KV-heavy tiny llama: 4 layers of 4 KV heads of 32 (1 KiB... 4 KiB a position in float32).
KV_HEAVY = dict(head_dim=32, num_key_value_heads=4)


class Collect(Sink):
    def __init__(self):
        self.tokens: list[int] = []
        self.error: Hf2qError | None = None
        self.ended = False

    def chunk(self, chunk) -> None:
        self.tokens += chunk.tokens

    def done(self, stats, error=None) -> None:
        self.error, self.ended = error, True


def ledger(target, budget: int = 1 << 30, chunk: int = 512) -> MemoryLedger:
    return MemoryLedger(target, MemoryBudget(budget), chunk)


def run(sched: Scheduler) -> list[list[int]]:
    """Step until idle; the ids of the live generations after each step."""
    live = []
    while not sched.idle:
        sched.step()
        live.append([e.id for e in (*sched.joining, *sched.rows, *sched.alone)])
    return live


# -- sizes ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [("12GB", 12 * 10**9), ("12GiB", 12 << 30), ("640MB", 640 * 10**6), ("640 mib", 640 << 20),
     ("1000000", 10**6), (4096, 4096), ("1.5GB", 1_500_000_000), ("2TB", 2 * 10**12)],
)  # fmt: skip
def test_sizes_read_decimal_and_binary_units_and_plain_bytes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "12XB", "-1GB", "0", "GB", "1e9", "12 G B", True, 0, 1.5, [1]])
def test_a_bad_size_is_an_error_naming_the_option(bad):
    with pytest.raises(Hf2qError, match="memory_budget"):
        MemoryBudget(bad).validate()


def test_the_default_budget_is_the_device_memory_less_the_margin():
    total, source = MemoryBudget().resolve()
    info = mx.device_info()
    if info.get("max_recommended_working_set_size"):
        want = info["max_recommended_working_set_size"]
    else:
        import os

        want = 0.8 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert total == int(int(want) * 0.9)
    assert "less 10%" in source


# -- the numbers on a tiny model ------------------------------------------------------
def test_the_weights_are_measured_from_the_parameters():
    target = tiny_target("llama")
    want = sum(a.nbytes for _, a in tree_flatten(target.model.parameters()))
    assert ledger(target).weights() == want > 0


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_row_costs_its_layouts_bytes_per_position(bits):
    target = tiny_target("llama", **KV_HEAVY)  # 4 layers x (keys + values) x 4 heads x 32
    kv = KVConfig(bits, 32) if bits else FULL_PRECISION
    per_position = 4 * 2 * 4 * (32 * 4 if bits is None else 32 * bits // 8 + 2 * 4)
    book = ledger(target)
    assert book.row(1000, kv) == 1000 * per_position
    assert book.row(4096, kv) / 4096 == kv_bytes_per_token(target, kv, 4096)


def test_sliding_windows_cost_their_window_and_recurrent_layers_their_state():
    window = ledger(tiny_target("gemma3_text"))  # window 16 on two of every three layers
    assert window.row(100_000, FULL_PRECISION) - window.row(50_000, FULL_PRECISION) == (
        50_000 * sum(2 * s.heads * s.k_dim * 4 for s in window.layers if s.kind == "kv")
    )
    hybrid = ledger(tiny_target("qwen3_next"))
    state = sum(2 * s.fixed_bytes for s in hybrid.layers if s.kind == "recurrent")
    attention = sum(2 * s.heads * s.k_dim * 4 for s in hybrid.layers if s.kind == "kv")
    assert state > 0 and hybrid.row(1000, FULL_PRECISION) == state + 1000 * attention


def test_a_reservation_holds_its_tokens_and_the_batch_pads_rows_to_the_longest():
    book = ledger(tiny_target("llama", **KV_HEAVY))
    short, long = (
        book.reserve(100, 50, FULL_PRECISION, width=9),
        book.reserve(2000, 500, FULL_PRECISION, width=9),
    )
    assert (short.columns, long.columns) == (150 + 18 + 2 * STEP, 2500 + 18 + 2 * STEP)
    alone, two = book.need([long]), book.need([short, long])
    row = book.row(long.columns, FULL_PRECISION)
    assert alone.kv == row
    assert two.kv == 3 * row  # both rows as long as the longest, and one more for a row's move
    assert two.transient > alone.transient > 0 and two.weights == alone.weights


def test_a_draft_models_and_a_drafters_weights_and_caches_count_against_the_budget(tmp_path):
    from test_dflash import published_folder

    target, draft = tiny_target("llama", **KV_HEAVY), tiny_target("llama", seed=1)
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(256 << 20)))
    drafted = sched.submit(
        random_prompt(100), make_config(max_tokens=40, method="draft", draft=draft), Collect()
    )
    sched.step()
    r = drafted.reservation
    assert r.own_models == (draft.model,) and r.own_bytes == kv_footprint(draft).bytes(r.columns) > 0
    assert sched.ledger.report.weights == model_bytes(target.model) + model_bytes(draft.model)
    assert sched.ledger.report.kv_reserved == sched.ledger.need([r]).kv + r.own_bytes
    run(sched)

    folder = published_folder(tmp_path, target)
    blocks = sched.submit(random_prompt(100), make_config(max_tokens=40, method="dflash", drafter=str(folder)),
                          Collect())  # fmt: skip
    sched.step()
    r = blocks.reservation
    (drafter,) = r.own_models
    cfg, size = drafter.config, drafter.fc.weight.dtype.size
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * size
    per_token += len(cfg.target_layer_ids) * cfg.hidden_size * size  # the captured target states
    assert r.own_bytes == r.columns * per_token
    assert sched.ledger.report.weights == model_bytes(target.model) + model_bytes(drafter)
    run(sched)


@pytest.mark.parametrize("arch, extra", [("llama", KV_HEAVY), ("gemma3_text", {}), ("qwen3_next", {})])
def test_the_activation_allowance_bounds_what_a_prefill_chunk_and_a_batched_round_take(arch, extra):
    target = tiny_target(arch, **extra)
    book = ledger(target)
    rt = target.runtime()
    rt.prefill(random_prompt(1500), logits="none")
    mx.eval(rt.state())
    held = arrays_bytes([rt.state()])
    peak = _peak(lambda: mx.eval(rt.prefill(random_prompt(512, 1), logits="none").hidden, rt.state()))
    grown = arrays_bytes([rt.state()]) - held
    assert peak - grown <= book.shape.bytes(1, 512, 2012 + STEP, 0) + book.layer(2012 + STEP, FULL_PRECISION)

    batch = BatchRuntime(target)
    for i in range(4):
        solo = target.runtime()
        solo.prefill(random_prompt(300 + 200 * i, i), logits="none")
        batch.add(i, solo)
    mx.eval(batch.forward([[1] * 9] * 4).logits, batch.state())
    columns = max(t.capacity for t in batch.tables.values())
    peak = _peak(lambda: mx.eval(batch.forward([[2] * 9] * 4).logits, batch.state()))
    assert peak <= book.shape.bytes(4, 9, columns, 36) + 4 * book.layer(columns, FULL_PRECISION)


def _peak(fn) -> int:
    """What ``fn`` takes at its peak over the memory active before it."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    return mx.get_peak_memory() - base


# -- admission ------------------------------------------------------------------------
def test_a_budget_smaller_than_the_model_is_an_error_naming_the_option():
    target = tiny_target("llama")
    with pytest.raises(Hf2qError, match="memory_budget") as e:
        Scheduler(target, SchedulerConfig(memory=MemoryBudget(100_000)))
    assert "weights take" in str(e.value)
    with pytest.raises(Hf2qError, match="memory must be a MemoryBudget"):
        Scheduler(target, SchedulerConfig(memory="8GB"))


def test_max_tokens_past_what_fits_alone_is_cut_to_it():
    target = tiny_target("llama", **KV_HEAVY)
    budget = 8 << 20
    fits = ledger(target, budget).fit(50, FULL_PRECISION, width=1)
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(budget)))
    sink = Collect()
    sched.submit(random_prompt(50), make_config(max_tokens=10**6, method="baseline"), sink)
    run(sched)
    assert sink.error is None and len(sink.tokens) == fits - 50 > 0
    assert sched.ledger.report.clamped == 1


def test_a_prompt_that_cannot_fit_is_refused_with_the_numbers_while_the_others_go_on():
    target = tiny_target("llama", **KV_HEAVY)
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(24 << 20)))
    sinks = [Collect() for _ in range(3)]
    for sink, n in zip(sinks, (40, 6000, 40)):
        sched.submit(random_prompt(n, n), make_config(max_tokens=20, method="ngram"), sink)
    run(sched)
    assert [len(s.tokens) for s in sinks] == [20, 0, 20]
    refused = sinks[1].error
    assert isinstance(refused, MemoryRefused) and refused.status == 413
    text = str(refused)
    assert "6000 prompt tokens plus 20" in text and "tokens (prompt and answer) fit" in text
    assert "memory_budget 24.0 MiB" in text and "bytes per token" in text and "of activations" in text
    assert sched.ledger.report.refusals == {"prompt_too_long": 1}


def test_requests_that_fit_one_at_a_time_wait_and_all_finish_in_order():
    target = tiny_target("llama", **KV_HEAVY)
    prompts = [random_prompt(200, i) for i in range(4)]
    want = [r.tokens for r in batch_generate(target, prompts, max_tokens=60, method="baseline")]
    book = ledger(target)
    one = book.reserve(200, 60, FULL_PRECISION, width=1)
    budget = (book.need([one]).total + book.need([one, one]).total) // 2  # one fits, two do not
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(budget)))
    sinks = [Collect() for _ in prompts]
    entries = [
        sched.submit(p, make_config(max_tokens=60, method="baseline"), s) for p, s in zip(prompts, sinks)
    ]
    live = run(sched)
    assert max(len(ids) for ids in live) == 1
    order = [ids[0] for ids in live if ids]
    assert list(dict.fromkeys(order)) == [e.id for e in entries]
    assert [s.tokens for s in sinks] == want and all(s.error is None for s in sinks)


def test_a_waiting_queue_past_its_bound_is_refused_with_the_numbers():
    target = tiny_target("llama", **KV_HEAVY)
    book = ledger(target)
    one = book.reserve(200, 60, FULL_PRECISION, width=1)
    budget = (book.need([one]).total + book.need([one, one]).total) // 2
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(budget, max_waiting=1)))
    config = make_config(max_tokens=60, method="baseline")
    sched.submit(random_prompt(200, 0), config, Collect())
    sched.step()
    sched.submit(random_prompt(200, 1), config, Collect())
    sched.step()
    assert sched.waiting_for_memory == 1
    with pytest.raises(MemoryRefused) as e:
        sched.submit(random_prompt(200, 2), config, Collect())
    assert e.value.status == 429
    text = str(e.value)
    assert "asks for 260 tokens (prompt 200, max_tokens 60)" in text and "1 requests already wait" in text
    assert "tokens fit beside the generations running" in text
    run(sched)
    assert sched.ledger.report.refusals == {"queue_full": 1}


def test_prompt_cache_snapshots_are_evicted_by_bytes_to_admit_a_request():
    target = tiny_target("llama", **KV_HEAVY)
    target.prompt_cache = cache = PromptCache(8, 1 << 30)
    old = [random_prompt(300, 10 + i) for i in range(3)]
    batch_generate(target, old, max_tokens=8, method="baseline")
    held = [s.tokens for s in cache.snapshots()]
    assert len(held) == 3
    book = ledger(target)
    fresh = book.reserve(300, 40, FULL_PRECISION, width=1)
    budget = book.need([fresh], prompt_cache=False).total + cache.nbytes // 2  # room for about half of them
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(budget)))
    sink = Collect()
    sched.submit(random_prompt(300, 99), make_config(max_tokens=40, method="baseline"), sink)
    run(sched)
    assert sink.error is None and len(sink.tokens) == 40
    assert sched.ledger.report.evictions >= 1
    kept = [s.tokens for s in cache.snapshots()]
    assert held[0] not in kept and held[2] in kept  # least recently used first


def test_peak_mlx_memory_of_a_batched_run_stays_within_the_budget():
    target = tiny_target("llama", **KV_HEAVY)
    book = ledger(target, chunk=128)
    one = book.reserve(400, 200, FULL_PRECISION, width=9)
    budget = book.need([one, one, one]).total  # about three at once
    sched = Scheduler(target, SchedulerConfig(prefill_chunk=128, memory=MemoryBudget(budget)))
    sinks = [Collect() for _ in range(8)]
    for i, sink in enumerate(sinks):
        sched.submit(random_prompt(250 + 50 * (i % 4), i), make_config(max_tokens=200, method="ngram"), sink)
    mx.clear_cache()
    others = mx.get_active_memory() - book.weights()  # arrays of other tests still alive
    mx.reset_peak_memory()
    waited = 0
    while not sched.idle:
        sched.step()
        waited = max(waited, sched.waiting_for_memory)
    peak = mx.get_peak_memory() - others
    assert all(s.error is None and len(s.tokens) == 200 for s in sinks)
    assert (
        waited > 0 and max(sched.rounds_by_size) >= 2
    )  # the budget held requests back; rows shared forwards
    assert peak <= budget, f"peak {peak} over the budget {budget}"
    print(f"peak {peak / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget, {waited} waited at most")


# -- MLX's buffer cache and allocation failures ----------------------------------------
def test_mlx_buffer_cache_is_given_back_in_a_long_batched_run():
    def cache_sizes(every: int) -> list[int]:
        target = tiny_target("llama", head_dim=32)
        sched = Scheduler(target, SchedulerConfig(max_batch=4, prefill_chunk=64, clear_cache_every=every))
        for i in range(32):
            config = make_config(max_tokens=40 + 13 * (i % 5), method="baseline")
            sched.submit(random_prompt(50 + 37 * (i % 7), i), config, Collect())
        mx.clear_cache()
        sizes = []
        while not sched.idle:
            sched.step()
            sizes.append(mx.get_cache_memory())
        return sizes

    limit = mx.set_cache_limit(1 << 32)  # as on Metal, where the cache may grow to the memory limit
    try:
        kept, given_back = cache_sizes(0), cache_sizes(64)
    finally:
        mx.set_cache_limit(limit)
    half = len(given_back) // 2
    assert kept[-1] >= 2 * kept[half // 2]  # never given back, it grows with the run
    assert max(given_back[half:]) <= 2 * max(given_back[:half])  # given back, it does not
    assert max(given_back) < 0.6 * max(kept)


def test_an_allocation_failure_fails_the_generations_of_its_forward_with_507_and_others_run(monkeypatch):
    message = "[metal::malloc] Attempting to allocate 99999999999 bytes which is greater than the maximum"
    assert isinstance(allocation_failure(RuntimeError(message)), MemoryExhausted)
    assert allocation_failure(RuntimeError("[matmul] shapes do not match")) is None
    target = tiny_target("llama")
    sched = Scheduler(target, SchedulerConfig(memory=MemoryBudget(64 << 20)))
    forward = BatchRuntime.forward
    calls = []

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(message)
        return forward(self, *a, **kw)

    monkeypatch.setattr(BatchRuntime, "forward", failing)
    first = [Collect(), Collect()]
    for i, sink in enumerate(first):
        sched.submit(random_prompt(30, i), make_config(max_tokens=30, method="baseline"), sink)
    run(sched)
    assert all(isinstance(s.error, MemoryExhausted) and s.error.status == 507 for s in first)
    assert "ran out of memory" in str(first[0].error)
    later = Collect()
    sched.submit(random_prompt(30, 5), make_config(max_tokens=30, method="baseline"), later)
    run(sched)
    assert later.error is None and len(later.tokens) == 30
    assert sched.ledger.report.refusals == {"allocation_failed": 2}
