"""Layer skip and DFlash as batch rows: a batch drafter drafts for all of a
method's rows at once (layer skip: partial forwards of the batch, rewound
before the verify; DFlash: one drafter forward over every row's own
context) and drafts what each row would draft alone; every row equals its
solo generation, with rejections, rows joining and leaving, methods mixed
in one verify, seeded sampling, cancellation, and generations moving from
alone into the batch and back; one read a round."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import assert_same_greedy
from models import random_prompt, tiny_target
from test_batching import PROMPTS, REJECTING, submit
from test_engine import loopy_prompt

import hf2q_py
import hf2q_py.batch.cache as slot_cache
from hf2q_py.batch.runtime import BatchRuntime
from hf2q_py.draft_length.batch import BatchCosts, DraftPlan, Offer
from hf2q_py.draft_length.policy import FixedK
from hf2q_py.proposers import layer_skip
from hf2q_py.proposers.base import Draft, DraftAsk
from hf2q_py.proposers.dflash import DFlashProposer
from hf2q_py.proposers.dflash_batch import DFlashRows
from hf2q_py.proposers.dflash_drafter import DraftVocab
from hf2q_py.proposers.layer_skip import LayerSkipProposer, LayerSkipRows
from hf2q_py.sampling import Greedy, Sampler, SamplingConfig
from hf2q_py.scheduler import Scheduler, SchedulerConfig
from hf2q_py.sequence import Sequence
from hf2q_py.tools.dflash_make import drafter_for
from hf2q_py.tools.reads import count_reads

#: (arch, scale, skip set): full attention; sliding windows of 16 (the answers run
#: past them); Gemma 4 skipping a KV source with the layer that shares it; a hybrid
#: skipping a recurrent layer (its state must not change) and an attention layer
#: (the recurrent layers that run are rolled back).
SKIPS = [
    ("llama", 2.0, [1]),
    ("gemma3_text", 1.0, [1, 2]),
    ("gemma4_text", 1.5, [2, 5]),
    ("qwen3_next", 1.0, [2]),
    ("qwen3_next", 1.0, [1]),
]
ARCHS = [("llama", 2.0), ("gemma3_text", 1.0), ("gemma4_text", 1.5), ("qwen3_next", 1.0)]


def drafter(target, **kw):
    """A random DFlash drafter for ``target`` (a sliding layer and a full one)."""
    ids = [0, 2] if target.num_layers < 6 else [1, 4]
    shape = dict(layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    return drafter_for(target, target_layer_ids=ids, block_size=6, **{**shape, **kw})


def layerskip(skip, **kw):
    return dict(method="layerskip", skip_layers=skip, k=4, adaptive=False, **kw)


def dflash(target, **kw):
    return dict(method="dflash", drafter=drafter(target), k=5, adaptive=False, **kw)


# -- the batch drafters themselves ------------------------------------------------


def prefilled(target, prompt):
    rt = target.runtime(rollback=24)
    rt.prefill(prompt[:-1], logits="none")
    return rt


@pytest.mark.parametrize("arch, scale, skip", SKIPS)
@pytest.mark.parametrize("step", [256, 8])  # 8: the slots are packed while the rows draft
@pytest.mark.parametrize("sampled", [False, True])
def test_layer_skip_rows_draft_what_each_drafts_alone_and_leave_the_caches_as_they_were(
    monkeypatch, arch, scale, skip, step, sampled
):
    monkeypatch.setattr(slot_cache, "STEP", step)
    target = tiny_target(arch, scale=scale)
    prompts = [random_prompt(30, 1), random_prompt(9, 2), random_prompt(21, 3)]
    batch = BatchRuntime(target)
    solos = [prefilled(target, p) for p in prompts]
    for i, p in enumerate(prompts):
        batch.add(i, prefilled(target, p))
    rows = LayerSkipRows(batch, skip, target.model)

    def proposer(i):
        p = LayerSkipProposer(target, skip)
        decider = Sampler(SamplingConfig(temperature=0.8, seed=i)) if sampled else Greedy()
        p.start(solos[i], prompts[i], {}, decider)
        return p

    drafting = {0: 4, 2: 3}  # row 1 is not a layer-skip row: it feeds nothing
    proposers = {i: proposer(i) for i in drafting}
    for i, p in proposers.items():
        rows.join(i, p)
    asks = [DraftAsk(i, proposers[i], prompts[i], k) for i, k in drafting.items()]
    got = rows.propose(asks)
    for a, draft in zip(asks, got):
        want = proposers[a.row].propose(prompts[a.row], a.k)  # alone, on its own runtime
        assert draft.tokens.tolist() == want.tokens.tolist()
        assert (draft.probs is None) == (want.probs is None)
        if sampled:
            assert mx.allclose(draft.probs, want.probs, atol=1e-5).item()
    feeds = [[prompts[i][-1], *random_prompt(3, 10 + i)] for i in range(3)]
    verify = batch.forward(feeds).logits
    for i in range(3):  # the draft positions are gone on every layer, recurrent states included
        assert mx.allclose(verify[i], solos[i].forward(feeds[i]).logits, atol=1e-4).item()


@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_one_dflash_forward_drafts_what_each_row_drafts_alone(vocab, sampled):
    """Rows with contexts of different lengths, growing by different amounts
    each round (what each accepted), one leaving and coming back: the
    batched forward's drafts (and their distributions) are each row's own."""
    target = tiny_target("llama", scale=1.5)
    d = drafter(target)
    if vocab:
        d.vocab = DraftVocab(list(range(0, target.vocab_size, 3)), target.vocab_size)
    H = target.hidden_size
    keys = iter(mx.random.split(mx.random.key(5), 1000))

    def hidden(n):
        return {i: mx.random.normal((1, n, H), key=next(keys)) for i in d.config.target_layer_ids}

    def pair(i, n):
        decider = Sampler(SamplingConfig(temperature=0.8, seed=i)) if sampled else Greedy()
        h = hidden(n - 1)
        twins = [DFlashProposer(target, d), DFlashProposer(target, d)]
        for p in twins:
            p.start(None, [], h, decider)
        return twins

    lengths = [20, 3, 11]
    twins = [pair(i, n) for i, n in enumerate(lengths)]
    tokens = [random_prompt(n, 20 + i) for i, n in enumerate(lengths)]
    rows = DFlashRows(d, twins[0][0].head)
    rows.join(0, twins[0][0])
    rows.join(1, twins[1][0])
    joined = {0, 1}
    ks = [5, 2, 4]
    for r in range(6):
        if r == 2:
            rows.join(2, twins[2][0])  # its prompt's features move in with it
            joined.add(2)
        if r == 3:
            rows.leave(1, twins[1][0])  # drafts alone for a round, then comes back
            joined.discard(1)
        if r == 4:
            rows.join(1, twins[1][0])
            joined.add(1)
        asks = [DraftAsk(i, twins[i][0], tokens[i], ks[i]) for i in sorted(joined)]
        got = dict(zip(sorted(joined), rows.propose(asks)))
        for i in range(3):
            want = twins[i][1].propose(tokens[i], ks[i])
            draft = got[i] if i in joined else twins[i][0].propose(tokens[i], ks[i])
            assert draft.tokens.tolist() == want.tokens.tolist(), (r, i)
            if sampled:
                assert mx.allclose(draft.probs, want.probs, atol=1e-5).item()
        for i in range(3):  # a round: i + 1 positions verified (accepted + 1), different per row
            n = 1 + (i + r) % 4
            h = hidden(n)
            for p in twins[i]:
                p.update(tokens[i] + random_prompt(n, r), ks[i], n - 1, h)
            tokens[i] = tokens[i] + random_prompt(n, r)


def test_a_draft_plan_stands_down_when_no_draft_pays_and_probes_now_and_then():
    plan = DraftPlan(step_cost=0.8, costs=BatchCosts(slope=0.02))  # a GPU's: wide forwards cost little
    assert plan.drafts([Offer(4, fixed=True), Offer(6, [0.1] * 6)]) == 4  # a fixed K gets all its drafts
    assert plan.drafts([Offer(4, [0.99, 0.98, 0.97, 0.96])] * 4) > 0  # drafts that pay
    weak = [Offer(4, [0.2, 0.04, 0.01, 0.0])] * 4
    counts = [plan.drafts(weak) for _ in range(40)]
    assert counts[:7] == [0] * 7 and counts.count(plan.probes.probe_k) >= 1  # a probe after a cool-down
    assert sum(counts) <= 2 * plan.probes.probe_k  # failed probes back off


# -- in the scheduler ----------------------------------------------------------------


@pytest.mark.parametrize("arch, scale, skip", SKIPS)
def test_layer_skip_rows_equal_their_solo_generations(arch, scale, skip):
    target = tiny_target(arch, scale=scale)
    options = layerskip(skip)
    want = [hf2q_py.generate(target, p, max_tokens=40, **options) for p in PROMPTS]
    got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=40, max_batch=3, **options)
    for p, g, w in zip(PROMPTS, got, want):
        assert_same_greedy(target.model, p, g.tokens, w.tokens)
        assert (g.stats.drafted, g.stats.accepted) == (w.stats.drafted, w.stats.accepted)  # the same drafts
    assert sum(g.stats.drafted - g.stats.accepted for g in got) > 0, "the test should exercise rollback"


@pytest.mark.parametrize("arch, scale", ARCHS)
def test_dflash_rows_equal_their_solo_generations(arch, scale):
    target = tiny_target(arch, scale=scale)
    options = dflash(target)
    want = [hf2q_py.generate(target, p, max_tokens=40, **options) for p in PROMPTS]
    got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=40, max_batch=3, **options)
    for p, g, w in zip(PROMPTS, got, want):
        assert_same_greedy(target.model, p, g.tokens, w.tokens)
        assert (g.stats.drafted, g.stats.accepted) == (w.stats.drafted, w.stats.accepted)
    assert sum(g.stats.drafted - g.stats.accepted for g in got) > 0


class TruthfulDFlash(DFlashProposer):
    """A DFlash proposer whose first ``good`` drafts of each block are the
    target's own continuation (the drafter still runs, alone or batched), so
    rows accept different amounts and their contexts grow unevenly."""

    def __init__(self, target, drafter, truth, good):
        super().__init__(target, drafter)
        self.truth, self.good = truth, good

    def drafts(self, logits, tokens):
        drafts = super().drafts(logits, tokens)
        n = len(tokens)
        right = self.truth[n : n + min(self.good, len(drafts))]
        return Draft(mx.concatenate([mx.array(right, dtype=mx.uint32), drafts.tokens[len(right) :]]))


def test_dflash_rows_that_accept_different_amounts_keep_exact_contexts():
    """Between rounds each batched row's drafter context plus its pending
    features hold every committed position but the last."""
    target = tiny_target("gemma4_text", scale=1.5)
    d = drafter(target)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=3))
    sinks = []
    for i, prompt in enumerate(PROMPTS[:3]):
        truth = prompt + hf2q_py.generate(target, prompt, max_tokens=40, method="baseline").tokens
        p = TruthfulDFlash(target, d, truth, good=(1, 3, 5)[i])
        seq = Sequence(target, prompt, max_tokens=40, proposer=p, policy=FixedK(5))
        sink = submit_sequence(scheduler, seq)
        sinks.append((prompt, truth, sink))
    checks = 0
    while not scheduler.idle:
        scheduler.step()
        for entry in scheduler.rows:
            drafter_rows = scheduler._row_drafters[entry.id].contexts
            b = drafter_rows.rows.index(entry.id)
            pending = sum(f.shape[1] for f in entry.seq.proposer.pending)
            assert int(drafter_rows.table.offsets[b]) + pending == len(entry.seq.tokens) - 1
            checks += 1
    assert checks > 10
    for prompt, truth, sink in sinks:
        assert sink.tokens == truth[len(prompt) :]
    assert max(scheduler.rounds_by_size) == 3


def submit_sequence(scheduler, seq):
    from test_batching import Collect

    sink = Collect()
    scheduler.submit(seq.prompt, None, sink, sequence=seq)
    return sink


@pytest.mark.parametrize("arch, scale", [("llama", 2.0), ("gemma4_text", 1.5), ("qwen3_next", 1.0)])
def test_methods_mixed_in_a_batch_share_one_verify_and_one_read_a_round(arch, scale):
    target = tiny_target(arch, scale=scale)
    skip = [2, 5] if arch == "gemma4_text" else [1]
    jobs = [
        (PROMPTS[0], layerskip(skip)),
        (PROMPTS[1], dflash(target)),
        (PROMPTS[2], REJECTING),
        (PROMPTS[3], dict(method="baseline")),
        (loopy_prompt(30), layerskip(skip)),
        (PROMPTS[4], dflash(target)),
    ]
    scheduler = Scheduler(target, SchedulerConfig(max_batch=6))
    sinks = [submit(scheduler, target, p, max_tokens=40, **o)[1] for p, o in jobs]
    while scheduler.joining or scheduler.waiting or scheduler.incoming:
        scheduler.step()
    rounds = 0
    with count_reads() as reads:
        while len(scheduler.rows) > 2:  # (the last row leaves the batch to run alone: a read of its own)
            scheduler.step()
            rounds += 1
    assert rounds > 5 and reads.reads == rounds  # lazy drafts: one read a round
    scheduler.run()
    assert max(scheduler.rounds_by_size) == len(jobs)  # every method in one forward
    for (prompt, options), sink in zip(jobs, sinks):
        assert sink.error is None
        want = hf2q_py.generate(target, prompt, max_tokens=40, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)


@pytest.mark.parametrize("arch, scale", [("llama", 2.0), ("qwen3_next", 1.0)])
def test_seeded_sampling_with_batch_drafters_equals_sampling_alone(arch, scale):
    target = tiny_target(arch, scale=scale)
    for options in (layerskip([1], temperature=0.8, seed=3), dflash(target, temperature=0.8, seed=4)):
        want = [hf2q_py.generate(target, p, max_tokens=30, **options).tokens for p in PROMPTS]
        got = hf2q_py.batch_generate(target, PROMPTS, max_tokens=30, max_batch=4, **options)
        assert [g.tokens for g in got] == want


def test_layer_skip_and_dflash_rows_join_and_leave_mid_generation():
    target = tiny_target("gemma3_text", scale=1.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=3, prefill_chunk=8))
    budgets = [50, 12, 33, 5, 41]
    options = [layerskip([1, 2]), dflash(target), layerskip([1, 2]), dflash(target), layerskip([3])]
    sinks = []
    for i, (prompt, n, o) in enumerate(zip(PROMPTS, budgets, options)):
        sinks.append(submit(scheduler, target, prompt, max_tokens=n, **o)[1])
        for _ in range(3 * i):  # later prompts arrive while earlier ones run
            scheduler.step()
    scheduler.run()
    for prompt, n, o, sink in zip(PROMPTS, budgets, options, sinks):
        assert sink.error is None
        assert_same_greedy(
            target.model, prompt, sink.tokens, hf2q_py.generate(target, prompt, max_tokens=n, **o).tokens
        )
    assert max(scheduler.rounds_by_size) == 3


@pytest.mark.parametrize("method", ["layerskip", "dflash"])
@pytest.mark.parametrize("arch, scale", [("gemma4_text", 1.5), ("qwen3_next", 1.0)])
def test_a_generation_moves_from_alone_into_the_batch_and_back_with_its_drafting_state(method, arch, scale):
    target = tiny_target(arch, scale=scale)
    options = layerskip([1]) if method == "layerskip" else dflash(target)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    first, first_sink = submit(scheduler, target, PROMPTS[3], max_tokens=60, **options)
    for _ in range(8):
        scheduler.step()
    assert first in scheduler.alone  # alone: the single-sequence loop
    _, second_sink = submit(scheduler, target, PROMPTS[1], max_tokens=12, **options)
    batched = alone_again = False
    while not scheduler.idle:
        scheduler.step()
        batched |= first in scheduler.rows
        alone_again |= batched and first in scheduler.alone
    assert batched and alone_again
    for prompt, n, sink in ((PROMPTS[3], 60, first_sink), (PROMPTS[1], 12, second_sink)):
        want = hf2q_py.generate(target, prompt, max_tokens=n, **options)
        assert_same_greedy(target.model, prompt, sink.tokens, want.tokens)
    assert first.stats.drafted == hf2q_py.generate(target, PROMPTS[3], max_tokens=60, **options).stats.drafted


def test_a_calibrating_layer_skip_generation_runs_alone_and_joins_once_it_has_chosen(monkeypatch):
    monkeypatch.setattr(layer_skip, "MARGIN", 0.0)  # no candidate is dropped untried
    target = tiny_target("llama", scale=1.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    auto, auto_sink = submit(scheduler, target, PROMPTS[0], max_tokens=60, method="layerskip", k=4)
    for _ in range(2):  # its prompt in: it claims the calibration
        scheduler.step()
    other, other_sink = submit(scheduler, target, PROMPTS[3], max_tokens=60, method="layerskip", k=4)
    _, ngram_sink = submit(scheduler, target, PROMPTS[1], max_tokens=60, **REJECTING)
    calibrating_alone = joined = other_batched = False
    while not scheduler.idle:
        scheduler.step()
        if auto.seq is not None and auto.seq.proposer.trials:
            calibrating_alone |= auto in scheduler.alone
            assert auto not in scheduler.rows
            other_batched |= other in scheduler.rows  # meanwhile: plain decoding, a batch row
        joined |= auto in scheduler.rows
    assert calibrating_alone and joined and other_batched and "auto" in target.kept.skip_sets
    assert other.stats.drafted == 0 and not target.kept.calibrating
    for prompt, sink in ((PROMPTS[0], auto_sink), (PROMPTS[3], other_sink), (PROMPTS[1], ngram_sink)):
        want = hf2q_py.generate(target, prompt, max_tokens=60, method="baseline").tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)


def test_a_layer_skip_calibration_cut_short_lets_the_next_generation_calibrate(monkeypatch):
    monkeypatch.setattr(layer_skip, "MARGIN", 0.0)
    target = tiny_target("llama", scale=1.0)
    short = hf2q_py.generate(target, PROMPTS[0], max_tokens=3, method="layerskip", k=4)
    assert "auto" not in target.kept.skip_sets and not target.kept.calibrating and short.stats.drafted == 0
    hf2q_py.generate(target, PROMPTS[1], max_tokens=60, method="layerskip", k=4)
    assert "auto" in target.kept.skip_sets


def test_a_cancelled_layer_skip_or_dflash_row_stops_and_the_others_go_on():
    target = tiny_target("qwen3_next", scale=1.0)
    options = [layerskip([2]), dflash(target), layerskip([2]), dflash(target)]
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    entries = [submit(scheduler, target, p, max_tokens=40, **o) for p, o in zip(PROMPTS, options)]
    for _ in range(8):
        scheduler.step()
    for i in (0, 1):
        entries[i][0].cancel()
    scheduler.run()
    for i in (0, 1):
        assert entries[i][1].error is None and 0 < len(entries[i][1].tokens) < 40
    for i in (2, 3):
        want = hf2q_py.generate(target, PROMPTS[i], max_tokens=40, **options[i]).tokens
        assert_same_greedy(target.model, PROMPTS[i], entries[i][1].tokens, want)


def test_rewinding_a_batch_restores_every_row_and_recurrent_state():
    target = tiny_target("qwen3_next")
    batch = BatchRuntime(target)
    for i, p in enumerate([random_prompt(12, 1), random_prompt(5, 2)]):
        batch.add(i, prefilled(target, p))
    before = [mx.array(a) for c in batch.recurrent.caches for a in c.cache]
    offsets = [batch.offset(i) for i in range(2)]
    mark = batch.mark()
    batch.forward([[1, 2, 3], [4]])
    batch.forward([[5], []], skip_layers=[2])
    batch.forward([[6, 7], [8, 9]])
    batch.rewind(mark)
    assert [batch.offset(i) for i in range(2)] == offsets
    after = [a for c in batch.recurrent.caches for a in c.cache]
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    batch.add(2, prefilled(target, random_prompt(4, 3)))
    with pytest.raises(ValueError, match="rows changed"):
        batch.rewind(mark)
