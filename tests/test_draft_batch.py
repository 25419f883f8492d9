"""Draft-model speculation in a batch: the rows drafting with one draft model
share its batched forwards (``DraftBatch``), and every row still equals its
solo generation, whatever its draft model proposes (rejected, partly or
wholly accepted), whatever shares its batch, whenever it joins or leaves;
seeded sampling repeats solo sampling; one read a round without a
confidence rule, one a draft step at most with one; draft steps priced into
the round's plan."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import UNGATED, assert_same_greedy
from mlx.utils import tree_map
from models import random_prompt, tiny_target
from test_batching import PROMPTS, REJECTING, submit

import hf2q_py
from hf2q_py.draft_length.batch import (
    BatchCosts,
    CatchUpCosts,
    DraftPlan,
    Offer,
    StepCosts,
    Verify,
    plan_steps,
    plan_verify,
)
from hf2q_py.proposers.combined import CombinedProposer
from hf2q_py.proposers.draft_batch import DraftBatch, step_seconds
from hf2q_py.scheduler import Scheduler, SchedulerConfig
from hf2q_py.tools.reads import count_reads

#: Fixed K, no confidence rule, the model alone (no copies, no memory): every round drafts K lazily.
FIXED = dict(method="draft", k=4, adaptive=False, draft_suffix_depth=0, memory=False, **UNGATED)
#: Fixed K with the default confidence rule (draft_min_prob 0.5): drafts end where the draft is unsure.
GATED = dict(method="draft", k=5, adaptive=False, draft_suffix_depth=0, memory=False)
#: Fixed K with llama.cpp's rule instead: a draft ends before a token the draft model is unsure of.
P_MIN = dict(GATED, draft_p_min=0.3, draft_min_prob=0.0)
#: The draft method's defaults: adaptive K, copies where the context's end is matched, the rule.
DEFAULTS = dict(method="draft", memory=False)


def near_copy(target, arch: str, scale: float, noise: float = 0.02):
    """The target's architecture and weights, each weight off by ``noise`` (relative):
    a draft model whose drafts are partly accepted."""
    draft = tiny_target(arch, scale=scale)
    mx.random.seed(1)
    draft.model.update(
        tree_map(lambda w: w * (1 + noise * mx.random.normal(w.shape)), draft.model.parameters())
    )
    return draft


def draft_for(kind: str, target, arch: str, scale: float):
    if kind == "other":  # another random llama: drafts rejected
        return tiny_target("llama", seed=1, scale=2.0)
    if kind == "near":
        return near_copy(target, arch, scale)
    return target  # its own draft: drafts accepted


def run_batched(target, jobs, max_batch=4, max_tokens=50):
    """Every (prompt, options) submitted at once; the scheduler and each job's sink."""
    scheduler = Scheduler(target, SchedulerConfig(max_batch=max_batch))
    sinks = [submit(scheduler, target, p, max_tokens=max_tokens, **o)[1] for p, o in jobs]
    scheduler.run()
    return scheduler, sinks


def assert_each_equals_solo(target, jobs, sinks, max_tokens=50):
    for (prompt, options), sink in zip(jobs, sinks):
        assert sink.error is None, sink.error
        want = hf2q_py.generate(target, prompt, max_tokens=max_tokens, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)


@pytest.mark.parametrize(
    "arch, scale, kind",
    [
        ("llama", 2.0, "other"),
        ("llama", 2.0, "near"),
        ("llama", 2.0, "self"),
        ("gemma3_text", 1.0, "other"),
        ("gemma3_text", 1.0, "near"),
        ("gemma4_text", 1.5, "near"),
        ("gemma4_text", 1.5, "self"),
        ("qwen3_next", 1.0, "other"),
    ],
)
def test_batched_draft_model_rows_equal_their_solo_generations(arch, scale, kind):
    target = tiny_target(arch, scale=scale)
    draft = draft_for(kind, target, arch, scale)
    for options in (FIXED, GATED, DEFAULTS):
        jobs = [(p, dict(options, draft=draft)) for p in PROMPTS]
        scheduler, sinks = run_batched(target, jobs)
        assert_each_equals_solo(target, jobs, sinks)
        assert max(scheduler.rounds_by_size) == 4, "the draft rows should share the batch"
        drafted = sum(s.stats.drafted for s in sinks)
        accepted = sum(s.stats.accepted for s in sinks)
        if options is FIXED:
            assert drafted > 0
            assert (accepted < drafted) == (kind != "self"), (accepted, drafted)


def test_the_draft_models_rows_draft_with_one_batched_forward_per_step():
    target = tiny_target("llama", scale=2.0)
    draft = near_copy(target, "llama", 2.0)
    calls = []
    forward = DraftBatch.__dict__["_step"]

    def counted(self, feeding, i):
        calls.append(len(feeding))
        return forward(self, feeding, i)

    DraftBatch._step = counted
    try:
        scheduler, sinks = run_batched(target, [(p, dict(FIXED, draft=draft)) for p in PROMPTS[:4]])
    finally:
        DraftBatch._step = forward
    assert max(calls) == 4  # four rows fed in one forward
    assert all(s.error is None for s in sinks)


def test_draft_rows_join_and_leave_mid_generation_and_each_still_equals_solo():
    target = tiny_target("gemma4_text", scale=1.5)
    draft = near_copy(target, "gemma4_text", 1.5)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=3, prefill_chunk=8))
    budgets = [60, 12, 33, 5, 41]
    jobs = [(p, dict(o, draft=draft)) for p, o in zip(PROMPTS, (FIXED, GATED, DEFAULTS, FIXED, GATED))]
    sinks = []
    for i, ((prompt, options), n) in enumerate(zip(jobs, budgets)):
        sinks.append(submit(scheduler, target, prompt, max_tokens=n, **options)[1])
        for _ in range(3 * i):  # later prompts arrive while earlier ones run
            scheduler.step()
    scheduler.run()
    for (prompt, options), n, sink in zip(jobs, budgets, sinks):
        assert sink.error is None
        want = hf2q_py.generate(target, prompt, max_tokens=n, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)
    assert max(scheduler.rounds_by_size) == 3


@pytest.mark.parametrize("arch, scale", [("llama", 2.0), ("qwen3_next", 1.0)])
def test_draft_ngram_and_plain_rows_share_one_verify(arch, scale):
    target = tiny_target(arch, scale=scale)
    draft = tiny_target("llama", seed=1, scale=2.0)
    near = near_copy(target, arch, scale) if arch == "llama" else draft
    jobs = [
        (PROMPTS[0], dict(FIXED, draft=draft)),
        (PROMPTS[1], REJECTING),
        (PROMPTS[2], dict(method="baseline")),
        (PROMPTS[3], dict(GATED, draft=near)),
        (PROMPTS[4], dict(DEFAULTS, draft=draft)),
        (PROMPTS[0][5:], dict(P_MIN, draft=near)),
    ]
    scheduler, sinks = run_batched(target, jobs, max_batch=6)
    assert_each_equals_solo(target, jobs, sinks)
    assert max(scheduler.rounds_by_size) == 6


def sampled(options, draft):
    return [(p, dict(options, draft=draft, temperature=0.8, seed=3 + i)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("arch, scale", [("llama", 2.0), ("gemma4_text", 1.5), ("qwen3_next", 1.0)])
def test_seeded_sampling_with_a_draft_model_in_a_batch_equals_sampling_alone(arch, scale):
    """Equal where the rounds draft the same positions alone and batched: a
    fixed K (with ``draft_min_prob``, whose drafts keep their first token), or
    adaptive K (untimed under a seed) while the draft model drafts well.
    (Alone, a round that drafts nothing, where adaptive K stands down or
    ``draft_p_min`` ends a draft before its first token, is followed by a
    pipelined decode where a batch drafts again; both are exact samples,
    each repeats itself.)"""
    target = tiny_target(arch, scale=scale)
    if arch == "qwen3_next":  # no batchable draft of its kind: a llama, mostly rejected
        draft, variants = tiny_target("llama", seed=1, scale=2.0), (FIXED, GATED)
    else:
        draft, variants = (
            near_copy(target, arch, scale),
            (FIXED, GATED, dict(DEFAULTS, draft_suffix_depth=0), DEFAULTS),
        )
    for options in variants:
        jobs = sampled(options, draft)
        scheduler, sinks = run_batched(target, jobs, max_tokens=40)
        want = [hf2q_py.generate(target, p, max_tokens=40, **o).tokens for p, o in jobs]
        assert [s.tokens for s in sinks] == want, options
        assert max(scheduler.rounds_by_size) == 4


def test_seeded_sampling_with_adaptive_k_in_a_batch_repeats_itself():
    """The batch's measured costs never decide a seeded row's K (the second
    run starts from the first's timings)."""
    target = tiny_target("qwen3_next")
    draft = tiny_target("llama", seed=1, scale=2.0)  # drafts rejected: K stands down, then probes
    jobs = sampled(DEFAULTS, draft)
    first = [s.tokens for s in run_batched(target, jobs, max_tokens=40)[1]]
    assert [s.tokens for s in run_batched(target, jobs, max_tokens=40)[1]] == first


def test_a_cancelled_draft_row_stops_between_rounds_and_the_others_go_on():
    target = tiny_target("llama", scale=2.0)
    draft = near_copy(target, "llama", 2.0)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=3))
    jobs = [(p, dict(o, draft=draft)) for p, o in zip(PROMPTS[:3], (FIXED, GATED, DEFAULTS))]
    entries = [submit(scheduler, target, p, max_tokens=40, **o) for p, o in jobs]
    for _ in range(6):
        scheduler.step()
    entries[1][0].cancel()
    scheduler.run()
    cancelled = entries[1][1]
    assert cancelled.error is None and 0 < len(cancelled.tokens) < 40
    for i in (0, 2):
        want = hf2q_py.generate(target, jobs[i][0], max_tokens=40, **jobs[i][1]).tokens
        assert_same_greedy(target.model, jobs[i][0], entries[i][1].tokens, want)
    assert not scheduler._drafters  # the drafter went with its last row


@pytest.mark.parametrize("arch, scale", [("gemma4_text", 1.5), ("qwen3_next", 1.0)])
@pytest.mark.parametrize("options", [FIXED, DEFAULTS])
def test_a_draft_generation_moves_from_alone_into_the_batch_and_back_and_still_equals_solo(
    arch, scale, options
):
    target = tiny_target(arch, scale=scale)
    draft = (
        near_copy(target, arch, scale) if arch != "qwen3_next" else tiny_target("llama", seed=1, scale=2.0)
    )
    options = dict(options, draft=draft)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    first, first_sink = submit(scheduler, target, PROMPTS[3], max_tokens=60, **options)
    for _ in range(8):
        scheduler.step()
    assert first in scheduler.alone  # alone: the single-sequence loop, the draft on its own runtime
    _, second_sink = submit(scheduler, target, PROMPTS[1], max_tokens=12, **options)
    batched = alone_again = behind = False
    while not scheduler.idle:
        scheduler.step()
        batched |= first in scheduler.rows
        alone_again |= batched and first in scheduler.alone
        if scheduler.rows == [first]:  # its partner done: it stays only while its model is behind
            behind = not first.seq.proposer.goes_alone(first.seq.tokens)
            assert behind
    assert batched and (alone_again or behind)
    for prompt, n, sink in ((PROMPTS[3], 60, first_sink), (PROMPTS[1], 12, second_sink)):
        want = hf2q_py.generate(target, prompt, max_tokens=n, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)


def rounds_and_reads(target, options):
    """Four draft rows: the batched rounds run while all four share the batch, and the reads they made."""
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    for p, n in zip(PROMPTS[:4], (30, 35, 40, 45)):
        submit(scheduler, target, p, max_tokens=n, **options)
    while scheduler.joining or scheduler.waiting or scheduler.incoming:
        scheduler.step()
    for _ in range(2):  # the first rounds read the prompts into the draft model (its lazy prefill)
        scheduler.step()
    rounds = 0
    with count_reads() as reads:
        while len(scheduler.rows) == 4:
            scheduler.step()
            rounds += 1
    return rounds, reads.reads


def test_a_batched_round_of_lazy_drafts_makes_one_read_and_a_confidence_rule_one_per_step_at_most():
    target = tiny_target("llama", scale=2.0)
    draft = near_copy(target, "llama", 2.0)
    rounds, reads = rounds_and_reads(target, dict(FIXED, draft=draft))
    assert rounds > 5 and reads == rounds
    rounds, reads = rounds_and_reads(target, dict(GATED, draft=draft))
    assert rounds > 5 and rounds < reads <= rounds * 5  # K - 1 steps judged + the verify's read


def test_a_draft_model_with_recurrent_layers_runs_alone_beside_the_batch():
    target = tiny_target("llama", scale=2.0)
    draft = tiny_target("qwen3_next", seed=1)
    jobs = [
        (PROMPTS[0], dict(FIXED, draft=draft)),
        (PROMPTS[1], REJECTING),
        (PROMPTS[2], dict(method="baseline")),
    ]
    scheduler, sinks = run_batched(target, jobs)
    assert_each_equals_solo(target, jobs, sinks)
    assert max(scheduler.rounds_by_size) == 2  # the draft-model row was never in the batch


# -- the plan ---------------------------------------------------------------------
def test_dearer_draft_steps_plan_fewer_of_them():
    costs = BatchCosts()
    rows = [Offer(8, [0.9**j for j in range(1, 9)])] * 4
    steps = [plan_steps(rows, [], costs, step) for step in (0.0, 0.1, 0.5, 2.0)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
    assert plan_steps(rows, [], costs, 100.0) == 0  # drafting that cannot pay: a decode
    assert plan_steps([Offer(3, fixed=True)], [], costs, 100.0) == 3  # a fixed K is drafted whole


def test_the_batch_cost_curve_does_not_believe_a_size_measured_dearer_than_its_neighbours_line():
    costs = BatchCosts()
    measured = [(16, 0.75), (28, 1.43), (48, 1.5), (132, 3.66)]  # 28: a round that also waited
    for positions, seconds in measured:
        costs.update(positions, seconds)
    assert costs.points() == [(16, 0.75), (48, 1.5), (132, 3.66)]
    assert costs.cost(32) == pytest.approx(0.75 + 0.75 * 16 / 32)


def test_the_batch_cost_curve_past_its_largest_size_is_a_hopeful_guess_the_next_round_corrects():
    costs = BatchCosts()
    for positions, seconds in [(4, 0.5), (8, 0.6), (12, 0.9)]:  # a steep last pair
        costs.update(positions, seconds)
    assert costs.cost(20) == pytest.approx(0.9 + 0.025 * 8)  # on the least slope, not the last one
    costs.update(20, 2.0)
    assert costs.cost(20) == pytest.approx(2.0)


def test_a_drafters_step_is_priced_from_its_measured_seconds_along_the_batchs_cost_curve():
    costs, steps = BatchCosts(), StepCosts(ratio=0.25)
    assert steps.price(4, costs) == pytest.approx(0.25 * costs.cost(4))  # the prior, relative units
    costs.update(4, 0.2)
    costs.update(8, 0.3)
    assert steps.price(4, costs) == pytest.approx(0.05)  # the prior, in seconds now
    steps.update(4, 0.08)
    assert steps.price(4, costs) == pytest.approx(0.08)
    assert steps.price(8, costs) == pytest.approx(0.08 * 0.3 / 0.2)


def test_a_draft_step_is_timed_between_reads_not_from_the_catch_up_before_the_first():
    # the first read came back after a 3-second lazy prefill; the steps after it took 0.2 s each
    assert step_seconds([(1, 3.0), (2, 3.2), (4, 3.6)]) == pytest.approx(0.2)
    assert step_seconds([(1, 3.0)]) is None  # one read: nothing between reads to time
    assert step_seconds([]) is None


def test_a_draft_model_whose_steps_never_pay_probes_again_with_its_own_step_price():
    costs = BatchCosts()
    costs.update(4, 0.5)
    costs.update(16, 0.7)
    plan = DraftPlan(costs=costs)
    rows = [Offer(8, [0.9**j for j in range(1, 9)])] * 4
    assert plan.drafts(rows, step=0.05) > 0  # cheap steps pay
    counts = [plan.drafts(rows, step=50.0) for _ in range(40)]  # a step priced far too dear ...
    assert counts[0] == 0 and max(counts) == plan.probes.probe_k  # ... still probes now and then
    assert plan.drafts(rows, step=0.05) > 0  # and drafts again once its price is right


def cpu_costs() -> BatchCosts:
    """A compute-bound forward: a third of a second to read the weights, 23 ms a position."""
    costs = BatchCosts()
    for n in (1, 4, 16, 64, 132):
        costs.update(n, 0.34 + 0.023 * n)
    return costs


def test_a_row_copying_a_long_run_is_verified_apart_from_rows_with_no_drafts_where_forwards_are_ragged():
    copying, plain = Offer(32, [0.97] * 32), Offer(0)
    offers = [plain, copying, plain, plain]
    assert plan_verify(offers, cpu_costs(), ragged=True) == [Verify((1,), 33), Verify((0, 2, 3), 1)]
    (one,) = plan_verify(offers, cpu_costs(), ragged=False)  # padded: one width for every row
    assert one.rows == (0, 1, 2, 3) and one.width < 33
    alike = [Offer(8, [0.9] * 8)] * 4  # rows alike share one forward
    assert len(plan_verify(alike, cpu_costs(), ragged=True)) == 1


def test_a_draft_models_catch_up_on_copied_tokens_counts_against_its_steps():
    rows, others = [Offer(8, [0.8**j for j in range(1, 9)])] * 2, [Offer(0)] * 2
    costs = cpu_costs()
    assert plan_steps(rows, others, costs, 0.05, ragged=True) > 0
    assert (
        plan_steps(rows, others, costs, 0.05, ragged=True, start=5.0) == 0
    )  # 100 copied tokens to read first
    catch_ups = CatchUpCosts()
    prior = catch_ups.price(10, 0.2, costs)  # the prior: a step scaled as the batch's forward of 10 positions
    assert prior == pytest.approx(0.2 * costs.cost(10) / costs.cost(1)) and 0.2 < prior < 10 * 0.2
    catch_ups.update(40, 2.0)
    assert catch_ups.price(10, 0.2, costs) == pytest.approx(0.5)  # measured: 50 ms a token


def test_batched_rows_of_a_draft_model_that_drafts_badly_draft_little():
    """Four rows of a draft model whose drafts are rejected: the plan stops
    paying for draft steps and wide verifies they do not use."""
    target = tiny_target("llama", scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)  # drafts rejected
    options = dict(method="draft", draft=draft, draft_suffix_depth=0, memory=False, **UNGATED)
    jobs = [(random_prompt(12, 10 + i), options) for i in range(4)]
    scheduler, sinks = run_batched(target, jobs, max_tokens=60)
    assert_each_equals_solo(target, jobs, sinks, max_tokens=60)
    late = [s.stats for s in sinks]
    assert sum(s.drafted for s in late) < sum(s.generated_tokens for s in late)


def test_rows_the_draft_model_drafts_nothing_for_copy_shallow_matches_instead():
    """Where no draft-model step pays (its drafts are rejected), a row's
    drafts come from copies of matches too shallow to prefer over the model,
    keyed as copy rounds; every row still equals its solo generation."""
    target = tiny_target("llama", scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)
    made = []
    fallback = CombinedProposer.fallback

    def spied(self, tokens, k):
        draft = fallback(self, tokens, k)
        made.append(draft)
        return draft

    CombinedProposer.fallback = spied
    try:
        jobs = [(p, dict(DEFAULTS, draft=draft)) for p in PROMPTS[:4]]
        scheduler, sinks = run_batched(target, jobs, max_tokens=60)
    finally:
        CombinedProposer.fallback = fallback
    assert_each_equals_solo(target, jobs, sinks, max_tokens=60)
    copies = [d for d in made if d]
    assert copies and all(d.key[0] == "copy" for d in copies)
    assert max(scheduler.rounds_by_size) == 4


def test_a_probe_waits_while_the_catch_up_it_would_pay_costs_more_than_its_steps():
    plan = DraftPlan(costs=cpu_costs())
    rows = [Offer(8, [0.9**j for j in range(1, 9)])] * 4
    assert max(plan.drafts(rows, step=50.0, start=1000.0) for _ in range(40)) == 0  # an unread prompt
    assert max(plan.drafts(rows, step=50.0) for _ in range(40)) == plan.probes.probe_k


def test_a_draft_plan_weighs_its_steps_against_the_copies_its_rows_make_without_them():
    """At K = 0 the rows verify what they draft without the model (shallow
    copies, ``idle``), not nothing: steps that beat one token a row lose to
    copies that promise more."""
    costs = cpu_costs()
    rows = [Offer(8, [0.9**j for j in range(1, 9)])] * 2
    copies = [Offer(8, [0.97**j for j in range(1, 9)])] * 2
    assert plan_steps(rows, [], costs, step=0.1) > 0
    assert plan_steps(rows, [], costs, step=0.1, idle=[Offer(0)] * 2) > 0  # no copies: as before
    assert plan_steps(rows, [], costs, step=0.1, idle=copies) == 0
    plan = DraftPlan(costs=cpu_costs())
    assert plan.drafts(rows, step=0.1, idle=copies) == 0


def test_the_last_row_stays_in_the_batch_while_its_draft_model_has_not_read_its_context():
    """A batch row that copied while its draft model drafted nothing (its
    steps never paid) is not moved alone when the others finish: alone it
    would read its whole context into the draft model before drafting, a
    cost the batch's planner prices and the lone loop does not. It still
    equals its solo generation."""
    target = tiny_target("llama", scale=2.0)
    draft = tiny_target("llama", seed=1, scale=2.0)  # drafts rejected: no step pays
    options = dict(DEFAULTS, draft=draft)
    scheduler = Scheduler(target, SchedulerConfig(max_batch=2))
    budgets = [40, 80]
    sinks = [submit(scheduler, target, p, max_tokens=n, **options)[1] for p, n in zip(PROMPTS, budgets)]
    last_rows, rows = 0, set()
    while not scheduler.idle:
        scheduler.step()
        for entry in scheduler.alone:  # moved out of the batch this step: only once caught up
            assert entry.id not in rows or entry.seq.proposer.goes_alone(entry.seq.tokens)
        rows = {e.id for e in scheduler.rows}
        if len(scheduler.rows) == 1 and not scheduler.joining:
            seq = scheduler.rows[0].seq
            assert not seq.proposer.goes_alone(seq.tokens)
            assert len(seq.tokens) - len(seq.proposer.model.cached) > 17
            last_rows += 1
    assert last_rows > 0
    for prompt, n, sink in zip(PROMPTS, budgets, sinks):
        assert sink.error is None, sink.error
        want = hf2q_py.generate(target, prompt, max_tokens=n, **options).tokens
        assert_same_greedy(target.model, prompt, sink.tokens, want)


def test_two_draft_models_in_one_batch_each_have_their_own_drafter():
    target = tiny_target("llama", scale=2.0)
    first, second = near_copy(target, "llama", 2.0), tiny_target("llama", seed=1, scale=2.0)
    jobs = [(p, dict(FIXED, draft=d)) for p, d in zip(PROMPTS[:4], (first, second, first, second))]
    scheduler = Scheduler(target, SchedulerConfig(max_batch=4))
    sinks = [submit(scheduler, target, p, max_tokens=40, **o)[1] for p, o in jobs]
    seen = 0
    while not scheduler.idle:
        scheduler.step()
        seen = max(seen, len(scheduler._drafters))
    assert seen == 2
    assert_each_equals_solo(target, jobs, sinks, max_tokens=40)


# -- the server ---------------------------------------------------------------------
def batch_rounds(server) -> dict[int, float]:
    """The server's batched forwards by batch size (from /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    raw = server.raw("GET", "/metrics")[2].decode()
    return {
        int(s.labels["size"]): s.value
        for f in text_string_to_metric_families(raw)
        for s in f.samples
        if s.name == "hf2q_batch_rounds_total"
    }


@pytest.mark.slow
def test_four_concurrent_clients_of_a_draft_model_server_each_get_their_answer_alone(tmp_path):
    import threading

    import openai
    from gguf_export import export
    from server_process import running_server

    export(tmp_path / "target.gguf", "llama", seed=4)
    export(tmp_path / "draft.gguf", "llama", seed=5)  # another random model: drafts mostly rejected
    prompts = ["def add(a, b):", "The quick brown fox", "Once upon a time", "import numpy as np"]
    flags = ("--model", str(tmp_path / "target.gguf"), "--draft-model", str(tmp_path / "draft.gguf"))
    with running_server(*flags, "--method", "draft", "--max-batch", "4", "--no-prompt-cache") as server:
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id

        def complete(prompt: str) -> tuple[list[int], dict]:
            r = client.completions.create(
                model=model, prompt=prompt, max_tokens=40, temperature=0,
                extra_body={"hf2q": {"return_tokens": True}},
            )  # fmt: skip
            return r.model_extra["hf2q"]["tokens"], r.model_extra["hf2q"]

        alone = {p: complete(p)[0] for p in prompts}
        before = batch_rounds(server)
        got: dict[str, tuple[list[int], dict]] = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, complete(p))) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        after = batch_rounds(server)
    assert {p: got[p][0] for p in prompts} == alone
    assert all(spec["method"].startswith("draft") and spec["drafted"] > 0 for _, spec in got.values())
    assert sum(n - before.get(size, 0) for size, n in after.items() if size > 2) > 0, "no shared forwards"
