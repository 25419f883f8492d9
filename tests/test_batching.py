"""Many generations in one batch: every row equals its solo generation
(token for token, or at a numerical near-tie), whatever shares its batch and
whenever it joined; rollback per row on every cache kind; one read a round."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import assert_same_greedy
from mlx_lm.models.cache import ArraysCache
from models import HYBRIDS, random_prompt, tiny_target
from test_engine import loopy_prompt

import hf2q_py
from hf2q_py.batch.runtime import BatchRuntime
from hf2q_py.errors import Hf2qError
from hf2q_py.generation import make_config
from hf2q_py.prompt_cache import PromptCache
from hf2q_py.scheduler import Scheduler, SchedulerConfig
from hf2q_py.tools.reads import count_reads

#: Prompts of different lengths: repetitive ones (drafts mostly accepted), random
#: ones (drafts mostly rejected) and a one-token prompt (nothing to prefill).
PROMPTS = [loopy_prompt(24), random_prompt(20, 1), random_prompt(5, 2), loopy_prompt(40)[3:], [7]]

# (arch, weight scale): full attention, sliding windows of 16 (the answers run past
# them), Gemma 4's KV sharing, and recurrent layers: gated delta, short convolutions, Mamba-2.
ARCHS = [
    ("llama", 2.0),
    ("gemma3_text", 1.0),
    ("gemma4_text", 1.5),
    ("qwen3_next", 1.0),
    ("lfm2", 1.0),
    ("nemotron_h", 1.0),
]

#: n-gram drafting with a fixed K and no memory: many drafts, many rejected.
REJECTING = dict(method="ngram", k=4, adaptive=False, memory=False)


def solo(target, prompts, **options):
    return [hf2q_py.generate(target, p, **options) for p in prompts]


def assert_rows_equal_solo(target, prompts, got, want):
    for p, g, w in zip(prompts, got, want):
        assert_same_greedy(target.model, p, g.tokens, w.tokens)


@pytest.mark.parametrize("arch, scale", ARCHS)
@pytest.mark.parametrize("options", [REJECTING, dict(method="ngram", memory=False), dict(method="baseline")])
def test_every_row_of_a_batch_equals_its_solo_generation(arch, scale, options):
    target = tiny_target(arch, scale=scale)
    want = solo(target, PROMPTS, max_tokens=50, **options)
    got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=50, max_batch=3, **options)
    assert_rows_equal_solo(target, PROMPTS, got, want)
    if options["method"] == "ngram":
        assert sum(g.stats.drafted - g.stats.accepted for g in got) > 0, "the test should exercise rollback"


@pytest.mark.parametrize("arch", HYBRIDS)
def test_ragged_and_trimmed_rows_hold_the_recurrent_state_of_their_own_tokens(arch):
    """A row fed fewer tokens than the widest (right-padded) and a row that
    trimmed part of its forward hold what a single sequence of their tokens
    holds (Mamba-2's scan needs each row's length, not only its mask)."""
    target = tiny_target(arch)
    prompts, feeds, trims = (
        [random_prompt(8, 1), random_prompt(6, 2), random_prompt(7, 3)],
        [4, 1, 3],
        [2, 0, 3],
    )
    batch = BatchRuntime(target)
    for i, p in enumerate(prompts):
        rt = target.runtime(rollback=8)
        rt.prefill(p, logits="none")
        batch.add(i, rt)
    fed = [random_prompt(n, 10 + i) for i, n in enumerate(feeds)]
    batch.forward(fed)
    for i, n in enumerate(trims):
        batch.trim(i, n)
    batch.settle()
    for i, (p, f, n) in enumerate(zip(prompts, fed, trims)):
        ref = target.runtime()
        ref.prefill(p + f[: len(f) - n], logits="none")
        want = [a for c in ref.cache if isinstance(c, ArraysCache) for a in c.cache]
        got = [a[i : i + 1] for c in batch.recurrent.caches for a in c.cache]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert mx.allclose(g, w, atol=1e-4).item(), (i, float(mx.abs(g - w).max()))


@pytest.mark.parametrize("arch, scale", [("llama", 2.0), ("gemma4_text", 1.5), ("qwen3_next", 1.0)])
def test_seeded_sampling_in_a_batch_equals_sampling_alone(arch, scale):
    target = tiny_target(arch, scale=scale)
    for options in (
        dict(REJECTING, temperature=0.8, seed=3),
        dict(method="baseline", temperature=0.8, seed=5),
    ):
        want = solo(target, PROMPTS, max_tokens=40, **options)
        got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=40, max_batch=4, **options)
        assert [g.tokens for g in got] == [w.tokens for w in want]


class Collect:
    def __init__(self):
        self.tokens, self.stats, self.error, self.chunks = [], None, None, 0

    def chunk(self, chunk):
        self.tokens += chunk.tokens
        self.chunks += 1

    def done(self, stats, error=None):
        self.stats, self.error = stats, error


def submit(scheduler, target, prompt, **options):
    sink = Collect()
    entry = scheduler.submit(list(prompt), make_config(**options), sink)
    return entry, sink


def test_rows_join_and_leave_mid_generation_and_each_still_equals_solo():
    target = tiny_target("gemma4_text", scale=1.5)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=2, prefill_chunk=8))
    budgets = [60, 12, 33, 5, 41]
    sinks = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, budgets)):
        sinks.append(submit(scheduler, target, prompt, max_tokens=n, **REJECTING)[1])
        for _ in range(3 * i):  # later prompts arrive while earlier ones run
            scheduler.step()
    scheduler.run()
    for prompt, n, sink in zip(PROMPTS, budgets, sinks):
        want = hf2q_py.generate(target, prompt, max_tokens=n, **REJECTING).tokens
        assert sink.error is None
        assert_same_greedy(target.model, prompt, sink.tokens, want)
        assert len(sink.tokens) <= n
    assert max(scheduler.rounds_by_size) == 2


@pytest.mark.parametrize("arch, scale", [("gemma4_text", 1.5), ("qwen3_next", 1.0)])
def test_a_generation_moves_from_alone_into_the_batch_and_back_and_still_equals_solo(arch, scale):
    target = tiny_target(arch, scale=scale)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    first, first_sink = submit(scheduler, target, PROMPTS[3], max_tokens=60, **REJECTING)
    for _ in range(8):
        scheduler.step()
    assert first in scheduler.alone  # alone: the single-sequence loop
    _, second_sink = submit(scheduler, target, PROMPTS[1], max_tokens=12, **REJECTING)
    batched = alone_again = False
    while not scheduler.idle:
        scheduler.step()
        batched |= first in scheduler.rows
        alone_again |= batched and first in scheduler.alone
    assert batched and alone_again
    for prompt, n, sink in ((PROMPTS[3], 60, first_sink), (PROMPTS[1], 12, second_sink)):
        assert_same_greedy(
            target.model,
            prompt,
            sink.tokens,
            hf2q_py.generate(target, prompt, max_tokens=n, **REJECTING).tokens,
        )


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding():
    target = tiny_target("llama")
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4, prefill_chunk=16))
    _, first = submit(scheduler, target, random_prompt(10), max_tokens=40, method="baseline")
    for _ in range(3):
        scheduler.step()
    before = len(first.tokens)
    entry, _ = submit(scheduler, target, random_prompt(120, 3), max_tokens=5, method="baseline")
    steps = 0
    while entry.seq is None or entry in scheduler.joining:
        scheduler.step()
        steps += 1
    assert steps >= 120 // 16  # one chunk a round
    assert len(first.tokens) - before >= steps - 1  # the running row decoded meanwhile
    scheduler.run()


def test_a_short_prompt_starts_before_a_long_one_ahead_of_it_and_none_waits_for_ever():
    target = tiny_target("llama")
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4, prefill_chunk=8))
    long_entry, _ = submit(scheduler, target, random_prompt(120, 3), max_tokens=5, method="baseline")
    short_entry, _ = submit(scheduler, target, random_prompt(6, 4), max_tokens=5, method="baseline")
    scheduler.step()
    assert short_entry not in scheduler.joining and long_entry in scheduler.joining
    for _ in range(3):  # short prompts keep arriving; the long one still gets its turn
        submit(scheduler, target, random_prompt(20, 5), max_tokens=40, method="baseline")
    first_chunk = next(n for n in range(1, 20) if (scheduler.step(), len(long_entry.seq.pending) < 119)[1])
    assert first_chunk <= 5  # passed over at most max_batch times
    scheduler.run()


def test_a_generation_whose_proposer_cannot_batch_runs_alone_beside_the_batch():
    from hf2q_py.proposers.base import PlainDecoding
    from hf2q_py.sequence import Sequence

    class Unshared(PlainDecoding):
        batchable = False  # as a proposer whose drafting forwards no batch can run

    target = tiny_target("llama", scale=2.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    jobs = [(PROMPTS[1], REJECTING), (PROMPTS[2], dict(method="baseline"))]
    sinks = [submit(scheduler, target, p, max_tokens=30, **o)[1] for p, o in jobs]
    alone = Collect()
    seq = Sequence(target, PROMPTS[0], max_tokens=30, proposer=Unshared())
    scheduler.submit(PROMPTS[0], None, alone, sequence=seq)
    scheduler.run()
    for (prompt, options), sink in zip(jobs, sinks):
        want = hf2q_py.generate(target, prompt, max_tokens=30, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)
    want = hf2q_py.generate(target, PROMPTS[0], max_tokens=30, method="baseline").tokens
    assert_same_greedy(target.model, PROMPTS[0], alone.tokens, want)
    assert max(scheduler.rounds_by_size) == 2  # the unshared one was never in the batch


def test_a_cancelled_row_stops_between_rounds_and_the_others_go_on():
    target = tiny_target("llama", scale=2.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=3))
    entries = [submit(scheduler, target, p, max_tokens=40, method="baseline") for p in PROMPTS[:3]]
    for _ in range(6):
        scheduler.step()
    entries[1][0].cancel()
    scheduler.run()
    cancelled = entries[1][1]
    assert cancelled.error is None and 0 < len(cancelled.tokens) < 40
    for i in (0, 2):
        want = hf2q_py.generate(target, PROMPTS[i], max_tokens=40).tokens
        assert_same_greedy(target.model, PROMPTS[i], entries[i][1].tokens, want)


def test_a_finished_row_leaves_a_state_the_next_request_reuses():
    target = tiny_target("gemma3_text")
    target.prompt_cache = PromptCache(4)
    prompt = random_prompt(30, 4)
    first = hf2q_py.batch_generate(target, [prompt, random_prompt(9, 5)], max_tokens=20, **REJECTING)[0]
    follow_up = prompt + first.tokens + random_prompt(6, 6)
    again = hf2q_py.batch_generate(target, [follow_up], max_tokens=20, **REJECTING)[0]
    assert again.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    target.prompt_cache = None
    want = hf2q_py.generate(target, follow_up, max_tokens=20, **REJECTING).tokens
    assert_same_greedy(target.model, follow_up, again.tokens, want)


def test_a_scheduler_applying_anothers_news_holds_the_same_generations_after_every_step():
    """What a sharded target's ranks rely on: the leading scheduler takes each
    step's news (submissions and cancellations, some arriving mid-step from
    its sinks), a following one applies it, and after every step both hold
    the same generations waiting, joining, batched and alone."""
    lead, follow = (Scheduler(tiny_target("llama", scale=2.0), SchedulerConfig(max_batch=3)) for _ in "ab")
    sent = []
    lead.announce = sent.append
    sinks = [submit(lead, lead.target, p, max_tokens=30, **REJECTING)[1] for p in PROMPTS[:2]]
    late = {}

    class MidStep(Collect):  # a submission and a cancellation that land during a step
        def chunk(self, chunk):
            super().chunk(chunk)
            if self.chunks == 3:
                late["entry"], late["sink"] = submit(
                    lead, lead.target, PROMPTS[3], max_tokens=20, **REJECTING
                )
                lead_entries[0].cancel()

    lead_entries = [lead.submit(PROMPTS[2], make_config(max_tokens=30, **REJECTING), MidStep())]

    def places(s: Scheduler) -> list[list[int]]:
        return [[e.id for e in q] for q in (s.waiting, s.joining, s.rows, s.alone)]

    while not lead.idle:
        lead.step()
        follow.step(sent[-1])
        assert places(lead) == places(follow)
    assert follow.idle and lead.rounds_by_size == follow.rounds_by_size and max(lead.rounds_by_size) == 3
    assert late["sink"].stats is not None and late["sink"].error is None and sinks[0].error is None
    assert lead_entries[0].halted and 0 < len(lead_entries[0].sink.tokens) < 30


def test_a_batched_round_makes_one_blocking_read():
    target = tiny_target("llama", scale=2.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    for p, n in zip(PROMPTS[:4], (30, 35, 40, 45)):
        submit(scheduler, target, p, max_tokens=n, **REJECTING)
    while scheduler.incoming or scheduler.waiting or scheduler.joining:
        scheduler.step()
    rounds = 0
    with count_reads() as reads:
        while len(scheduler.rows) > 2:  # (the last row leaves the batch to run alone: a read of its own)
            scheduler.step()
            rounds += 1
    assert rounds > 5 and reads.reads == rounds


def test_a_row_with_a_stop_string_ends_there_and_its_text_matches_solo():
    target = tiny_target("llama", scale=2.0, tokenizer=True)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[2]]
    free = hf2q_py.generate(target, prompts[0], max_tokens=30, method="baseline")
    stop = free.text[10:13]
    want = [hf2q_py.generate(target, p, max_tokens=30, stop=[stop], **REJECTING) for p in prompts]
    got = hf2q_py.batch_generate(target, prompts, max_tokens=30, stop=[stop], **REJECTING)
    assert [g.text for g in got] == [w.text for w in want]
    assert got[0].finish_reason == "stop" and stop not in got[0].text


def test_bad_batch_requests_are_refused_with_a_message():
    target = tiny_target("llama")
    with pytest.raises(Hf2qError, match="list of prompts"):
        hf2q_py.batch_generate(target, "one prompt", max_tokens=4)
    with pytest.raises(Hf2qError, match="max_batch"):
        Scheduler(target, SchedulerConfig(max_batch=0))
    with pytest.raises(Hf2qError, match="configs"):
        hf2q_py.batch_generate(target, [[1, 2]], configs=[make_config(), make_config()])
    with pytest.raises(Hf2qError, match="prompt"):
        hf2q_py.batch_generate(target, [[]], max_tokens=4)


@pytest.mark.parametrize("arch, scale", ARCHS[:3])
def test_a_forward_computes_only_the_rows_it_feeds_and_each_equals_its_solo_forward(arch, scale):
    assert_fed_rows_equal_solo(tiny_target(arch, scale=scale))


def assert_fed_rows_equal_solo(target) -> None:
    """Forwards feeding some rows of a batch of three: only those are computed,
    each as its own runtime computes it, and the others keep their positions."""
    prompts = [random_prompt(30, 1), random_prompt(9, 2), random_prompt(21, 3)]
    batch, solos = BatchRuntime(target), []
    for i, p in enumerate(prompts):
        solos.append(target.runtime())
        solos[-1].prefill(p, logits="none")
        rt = target.runtime()
        rt.prefill(p, logits="none")
        batch.add(i, rt)
    assert batch.ragged
    for feeds in ([[5, 6, 7], [], [8]], [[], [9, 10], []], [[11], [12], [13, 14]]):
        fwd = batch.forward(feeds)
        assert fwd.rows == tuple(b for b, f in enumerate(feeds) if f)
        assert fwd.logits.shape[0] == len(fwd.rows)  # the rows fed nothing were not computed
        for b, f in enumerate(feeds):
            if f:
                want = solos[b].forward(f).logits
                assert mx.allclose(fwd.logits[fwd.index(b), : len(f)], want, atol=1e-4).item(), (feeds, b)
    assert [batch.offset(i) for i in range(3)] == [rt.offset for rt in solos]


def test_a_batch_with_recurrent_layers_computes_every_row():
    target = tiny_target("qwen3_next")
    batch = BatchRuntime(target)
    for i, p in enumerate([random_prompt(12, 1), random_prompt(5, 2)]):
        rt = target.runtime()
        rt.prefill(p, logits="none")
        batch.add(i, rt)
    assert not batch.ragged
    assert batch.forward([[1, 2], []]).rows == (0, 1)
