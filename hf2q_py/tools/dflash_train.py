"""Training a DFlash drafter by self-distillation (``hf2q-py train-dflash``).

1. Data: the target answers a prompt set greedily (``data.self_distill``).
2. Features: the hidden states at the drafter's ``target_layer_ids`` (kept
   in memory as float16), taken while the answers are generated
   (``data.self_distill`` with ``capture_layers``), else by one target
   forward per sequence (answers read back from an earlier run), and the
   target's greedy choice at every position: where the prompt's own text
   agrees with it, blocks anchored in the prompt train too (a quarter of
   the blocks by default), which multiplies the data a few answers give.
3. Steps: each step takes one sequence and ``anchors`` random anchor
   positions in its answer. A block is ``[token at anchor] + masks``; it sees
   the context features before the anchor and predicts the next
   ``block_size - 1`` tokens. Losses are weighted by ``exp(-(i - 1) / gamma)``
   for block position i, as in the DFlash paper, since early positions
   decide most of the accepted length: cross-entropy through the target's
   head on the first ``ce_positions`` positions, and on every position a
   regression onto the target's own final states (EAGLE's feature loss),
   which costs no vocabulary-sized matmul: on a 2-core CPU the head is 80%
   of a step.
4. AdamW with warmup and cosine decay; every ``eval_every`` steps a held-out
   estimate of the mean accepted length (greedy drafts against the target's
   own greedy answer); checkpoints every ``checkpoint_every`` steps, written
   in the folder format ``load_drafter`` reads, plus optimizer state to resume.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..draft_length import MAX_K
from ..errors import Hf2qError
from ..validate import check_bool, check_float, check_int
from ..proposers.dflash_drafter import Drafter, DrafterConfig, TargetHead, load_drafter
from .dflash_make import default_layer_ids, drafter_for, frequency_vocab, save_drafter

STATE_DIR = "train-state"
RUN_FILE = "run.json"  # what the run's data was made from (see run_record)


@dataclass
class TrainConfig:
    """Options of ``hf2q-py train-dflash`` (defaults: the built-in model's run)."""

    out: str
    layers: int = 2
    block_size: int = 8
    target_layer_ids: Sequence[int] | None = None
    mask_token_id: int | None = None
    samples: int = 240
    max_new_tokens: int = 256
    steps: int = 3000
    anchors: int = 16
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 100
    gamma: float = 7.0
    ce_positions: int | None = 3  # block positions with cross-entropy (None: all)
    hidden_weight: float = 1.0  # weight of the final-state regression on every position
    prompt_anchors: float = 0.25  # share of blocks anchored anywhere (prompt text the target agrees with)
    holdout: int = 16
    eval_every: int = 250
    checkpoint_every: int = 250
    seed: int = 0
    max_minutes: float | None = None  # stop (with a checkpoint) after this much training time
    draft_vocab: int | None = (
        None  # a reduced draft vocabulary of this many tokens (None: the whole vocabulary)
    )
    warm_start: bool = False  # drafter layers start as copies of the target's last layers
    gen_batch: int = 8  # answers decoded at a time for the training data

    overwrite: bool = False  # prepare_out: start afresh in a folder holding other files or another run

    def validate(self) -> None:
        for name in (
            "layers",
            "samples",
            "max_new_tokens",
            "steps",
            "anchors",
            "eval_every",
            "checkpoint_every",
        ):
            check_int(name.replace("_", "-"), getattr(self, name), 1, LIMITS.get(name))
        check_int("block-size", self.block_size, 2, MAX_K + 1)
        check_int("holdout", self.holdout, 0)
        if not self.holdout < self.samples:
            raise Hf2qError(f"holdout must be in [0, samples), got {self.holdout}")
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
                raise Hf2qError(f"target-layers must be a non-empty list of layer ids, got {ids!r}")
            for i in ids:
                check_int("a target layer id", i, 0)
            if len(set(ids)) != len(ids):
                raise Hf2qError(f"target-layers lists a layer twice: {list(ids)}")
        if self.mask_token_id is not None:
            check_int("mask-token-id", self.mask_token_id, 0)
        if self.ce_positions is not None:
            check_int("ce-positions", self.ce_positions, 0)
        check_float("hidden-weight", self.hidden_weight, 0.0)
        if self.ce_positions == 0 and not self.hidden_weight:
            raise Hf2qError("with ce-positions 0 the hidden-weight must be > 0: nothing would be trained")
        if self.max_minutes is not None:
            check_float("max-minutes", self.max_minutes, 0.0)
        check_float("prompt-anchors", self.prompt_anchors, 0.0, 1.0)
        check_float("lr", self.lr, 0.0, lo_open=True)
        check_float("weight-decay", self.weight_decay, 0.0)
        check_int("warmup", self.warmup, 0)
        check_float("gamma", self.gamma, 0.0, lo_open=True)
        check_int("seed", self.seed)
        check_bool("overwrite", self.overwrite)
        check_bool("warm-start", self.warm_start)
        check_int("gen-batch", self.gen_batch, 1, 256)
        if self.draft_vocab is not None:
            check_int("draft-vocab", self.draft_vocab, 1)

    def feature_layers(self, target) -> list[int]:
        """The target layers a new drafter conditions on (``--target-layers``,
        else three spread over the target's layers)."""
        if self.target_layer_ids is not None:
            return list(self.target_layer_ids)
        return default_layer_ids(target.num_layers, 3)

    def check_target(self, target) -> None:
        """The options that depend on the target (layer ids, mask id), checked
        before any data is generated."""
        n = target.num_layers
        ids = self.feature_layers(target)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise Hf2qError(f"target-layers {bad} are out of range for a target with {n} layers (0..{n - 1})")
        vocab = target.vocab_size
        if self.mask_token_id is not None and vocab is not None and self.mask_token_id >= vocab:
            raise Hf2qError(
                f"mask-token-id {self.mask_token_id} is outside the target's vocabulary ({vocab})"
            )
        if self.draft_vocab is not None and vocab is not None and self.draft_vocab > vocab:
            raise Hf2qError(
                f"draft-vocab {self.draft_vocab} is larger than the target's vocabulary ({vocab})"
            )


#: Upper bounds of some options (others only need to be >= 1).
LIMITS = {"layers": 64, "samples": 100_000}


@dataclass
class TrainSequence:
    """One training sequence. ``agrees[j]``: token j is the target's own
    greedy choice after tokens[:j] (always so in a greedy answer; where the
    prompt's text agrees with the target too, its blocks train as well)."""

    tokens: mx.array  # (S,)
    features: mx.array  # (1, S, n_layers * H), float16
    first_anchor: int  # the last prompt token: the answer's blocks start here
    agrees: mx.array | None = None  # (S,) bool
    finals: mx.array | None = None  # (1, S, H) float16: the target's final-norm states


def target_features(target, tokens: list[int], layer_ids: Sequence[int]) -> mx.array:
    """Hidden states at ``layer_ids`` for every position, concatenated."""
    return target_pass(target, tokens, layer_ids)[0]


def target_pass(target, tokens: list[int], layer_ids: Sequence[int]) -> tuple[mx.array, mx.array, mx.array]:
    """(features, agrees, final states) of one sequence, from one target pass
    (in chunks of ``PREFILL_CHUNK`` positions, every position's logits kept)."""
    from ..target import PREFILL_CHUNK

    rt = target.runtime()
    feats, greedy, finals = [], [], []
    for start in range(0, len(tokens), PREFILL_CHUNK):
        fwd = rt.forward(
            tokens[start : start + PREFILL_CHUNK],
            logits="all",
            capture_layers=tuple(layer_ids),
            capture_final=True,
        )
        feats.append(mx.concatenate([fwd.hidden[i] for i in layer_ids], axis=-1).astype(mx.float16))
        greedy.append(mx.argmax(fwd.logits, axis=-1))  # the target's choice after each prefix
        finals.append(fwd.final.astype(mx.float16))
        mx.eval(rt.state(), feats[-1], greedy[-1], finals[-1])
    feats, finals = mx.concatenate(feats, axis=1), mx.concatenate(finals, axis=1)
    greedy = mx.concatenate(greedy)
    agrees = mx.concatenate([mx.array([False]), greedy[:-1] == mx.array(tokens[1:])])
    mx.eval(agrees)
    return feats, agrees, finals


def block_batch(
    seq: TrainSequence, anchors: mx.array, cfg: DrafterConfig
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(block tokens (N, B), labels (N, B-1), valid (N, B-1), ctx_visible (N, 1, 1, S))."""
    B, S = cfg.block_size, seq.tokens.shape[0]
    offsets = mx.arange(1, B)
    idx = anchors[:, None] + offsets[None]
    valid = idx < S
    labels = seq.tokens[mx.minimum(idx, S - 1)]
    if seq.agrees is not None:  # a label counts while the target's greedy chain follows the text
        valid = valid & (mx.cumprod(seq.agrees[mx.minimum(idx, S - 1)].astype(mx.int32), axis=1) > 0)
    mask = mx.full((anchors.shape[0], B - 1), cfg.mask_token_id, dtype=seq.tokens.dtype)
    block = mx.concatenate([seq.tokens[anchors][:, None], mask], axis=1)
    visible = (mx.arange(S)[None] < anchors[:, None])[:, None, None, :]
    return block, labels, valid, visible


def block_loss(
    drafter: Drafter,
    head: TargetHead,
    seq: TrainSequence,
    anchors: mx.array,
    weights: mx.array,
    ce_positions: int | None = None,
    hidden_weight: float = 0.0,
) -> mx.array:
    """Position-weighted cross-entropy on the first ``ce_positions`` block
    positions (all when None), plus ``hidden_weight`` x the relative squared
    error between the drafter's states and the target's own final states for
    the same predictions (EAGLE's feature regression: it trains every
    position without paying for the vocabulary-sized head). With a draft
    vocabulary the cross-entropy is over its tokens, and labels outside it
    (which the drafter can never propose) do not count in it."""
    block, labels, valid, visible = block_batch(seq, anchors, drafter.config)
    h = drafter(head.embed(block), seq.features.astype(mx.float32), block_pos=anchors, ctx_visible=visible)[
        :, 1:
    ]
    w = weights[None] * valid
    P = h.shape[1] if ce_positions is None else min(ce_positions, h.shape[1])
    loss = mx.array(0.0)
    if P > 0:
        wp, lp = w[:, :P], labels[:, :P]
        if head.vocab is not None:
            lp = head.vocab.index[lp]
            wp = wp * (lp >= 0)
            lp = mx.maximum(lp, 0)
        ce = nn.losses.cross_entropy(head.draft_logits(h[:, :P]), lp)
        loss = (ce * wp).sum() / mx.maximum(wp.sum(), 1e-6)
    if hidden_weight and seq.finals is not None:
        S = seq.tokens.shape[0]
        idx = mx.minimum(
            anchors[:, None] + mx.arange(h.shape[1])[None], S - 1
        )  # state predicting token idx+1
        want = seq.finals[0][idx].astype(mx.float32)
        err = ((h - want) ** 2).mean(axis=-1) / mx.maximum((want**2).mean(axis=-1), 1e-6)
        loss = loss + hidden_weight * (err * w).sum() / mx.maximum(w.sum(), 1e-6)
    return loss


def accepted_lengths(drafter: Drafter, head: TargetHead, seq: TrainSequence, anchors: mx.array) -> mx.array:
    """Per anchor: 1 + the number of leading greedy drafts equal to the labels
    (the target's own greedy tokens)."""
    block, labels, valid, visible = block_batch(seq, anchors, drafter.config)
    h = drafter(head.embed(block), seq.features.astype(mx.float32), block_pos=anchors, ctx_visible=visible)
    drafts = mx.argmax(head.draft_logits(h[:, 1:]), axis=-1)
    if head.vocab is not None:
        drafts = head.vocab.ids[drafts]
    hits = (drafts == labels) & valid
    return 1 + mx.cumprod(hits.astype(mx.int32), axis=1).sum(axis=1)


def _anchors(rng: random.Random, seq: TrainSequence, n: int, start: int | None = None) -> mx.array | None:
    lo, hi = (seq.first_anchor if start is None else start), seq.tokens.shape[0] - 2
    if hi < lo:
        return None
    span = range(lo, hi + 1)
    return mx.array(sorted(rng.sample(span, min(n, len(span)))), dtype=mx.int32)


def _progress(step: int, total: int, loss: float, mal: float | None, sec: float) -> str:
    width = 24
    filled = int(width * step / total)
    eta = sec * (total - step)
    mal_s = f"{mal:.2f}" if mal is not None else "-"
    return (
        f"\r[{'#' * filled}{'.' * (width - filled)}] step {step}/{total} loss {loss:.3f} "
        f"held-out MAL {mal_s} {sec:.2f} s/step eta {eta / 60:.0f} min "
    )


def state_dir(cfg: TrainConfig) -> Path:
    """The run's working folder inside ``cfg.out`` (created). A folder that
    holds other files but no run (a model folder, say) is refused: its
    ``config.json`` and weights would be replaced (see ``prepare_out``)."""
    out = Path(cfg.out)
    path = out / STATE_DIR
    if out.is_dir() and not path.is_dir() and not cfg.overwrite and any(out.iterdir()):
        raise Hf2qError(
            f"{cfg.out} is not empty and holds no train-dflash run: its files would be replaced "
            "(choose a new --out, or pass --overwrite)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Hf2qError(f"cannot use {cfg.out} as the drafter folder: {e.strerror}") from None
    return path


def data_path(cfg: TrainConfig) -> Path:
    """Where the self-distilled sequences of a run are kept (resumable)."""
    return state_dir(cfg) / "data.jsonl"


def run_record(target: str | None, prompts: Sequence[str], max_new_tokens: int) -> dict:
    """What a run's training data depends on: the target source (None: the
    built-in model), a digest of the prompts, and the answer length."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(p.encode("utf-8", "surrogatepass") + b"\0")
    if target is None or str(target) == "":
        source = "built-in"
    else:
        path = Path(target).expanduser()
        source = str(path.resolve()) if path.exists() else str(target)
    return {
        "target": source,
        "prompts": len(prompts),
        "prompts_sha256": digest.hexdigest(),
        "max_new_tokens": max_new_tokens,
    }


def prepare_out(cfg: TrainConfig, record: dict) -> Path:
    """Check ``cfg.out`` before any slow work; returns the data file.

    A new or empty folder starts a run. A folder holding a run resumes it only
    if ``record`` (``run_record``) equals the one the run was started with,
    so new prompts or another target never train silently on old data. With
    ``cfg.overwrite`` the folder's drafter files (``config.json``,
    ``*.safetensors``) and run state are deleted and a new run starts; without
    it a folder holding anything else is refused.
    """
    out = Path(cfg.out)
    work = out / STATE_DIR
    if cfg.overwrite and out.is_dir():
        for f in [out / "config.json", *out.glob("*.safetensors")]:
            if f.is_file():
                f.unlink()
        if work.is_dir():
            shutil.rmtree(work)
    path = data_path(cfg)
    run_file = work / RUN_FILE
    if run_file.is_file():
        try:
            old = json.loads(run_file.read_text())
        except ValueError:
            old = None
        if old != record:
            what = [k for k in record if not isinstance(old, dict) or old.get(k) != record[k]]
            names = {
                "target": "--target",
                "prompts": "--samples",
                "prompts_sha256": "--prompts",
                "max_new_tokens": "--max-new-tokens",
            }
            raise Hf2qError(
                f"{cfg.out} holds a run with another {', '.join(dict.fromkeys(names[k] for k in what))}: "
                "resume with the same options, or choose a new --out, or pass --overwrite"
            )
    elif path.exists() or (work / "trainer.json").exists():
        raise Hf2qError(
            f"{cfg.out} holds a run without a record of its prompts and target: "
            "choose a new --out, or pass --overwrite to start afresh"
        )
    else:
        run_file.write_text(json.dumps(record, indent=1) + "\n")
    return path


def train(
    target,
    cfg: TrainConfig,
    rows: Sequence[dict],
    *,
    log: Callable[[str], None] | None = None,
    progress: bool = True,
) -> Drafter:
    """Train (or resume training) on ``rows`` ({"prompt_tokens": n, "tokens":
    [...]}, as ``data.self_distill`` writes them; a row's ``"captured"``
    pass for the drafter's layers stands in for its target pass); returns the
    drafter, also saved in ``cfg.out``."""
    cfg.validate()
    cfg.check_target(target)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    work = state_dir(cfg)
    resume = (work / "trainer.json").is_file()
    drafter, state = resumed_drafter(cfg, work) if resume else new_drafter(target, cfg, rows)
    dcfg = drafter.config
    head = TargetHead(target, dcfg.input_embedding_scale, drafter.vocab)
    vocab_note = f", draft vocabulary {len(drafter.vocab)}" if drafter.vocab is not None else ""
    log(f"features: {len(rows)} sequences, layers {list(dcfg.target_layer_ids)}{vocab_note}")
    seqs = train_sequences(target, rows, dcfg.target_layer_ids, cfg.hidden_weight)
    if len(seqs) <= cfg.holdout:
        raise Hf2qError(f"only {len(seqs)} usable sequences; need more than holdout={cfg.holdout}")
    opt = optimizer(cfg, drafter, work if resume else None)
    run = _Run(target, cfg, drafter, head, opt, state, work, log)
    run_steps(run, seqs[: cfg.holdout], seqs[cfg.holdout :], progress)
    drafter.eval()
    return drafter


def resumed_drafter(cfg: TrainConfig, work: Path) -> tuple[Drafter, dict]:
    """The drafter and trainer state of the run in ``cfg.out``, refused when
    its shapes or draft vocabulary differ from ``cfg``'s."""
    out = Path(cfg.out)
    drafter = load_drafter(out)
    state = json.loads((work / "trainer.json").read_text())
    old, dcfg = state["config"], drafter.config
    if (
        old["block_size"] != cfg.block_size
        or old["layers"] != cfg.layers
        or (cfg.target_layer_ids is not None and list(dcfg.target_layer_ids) != list(cfg.target_layer_ids))
        or (cfg.mask_token_id is not None and dcfg.mask_token_id != cfg.mask_token_id)
    ):
        raise Hf2qError(f"{out} holds a run with other shapes; use another --out or the same options")
    if (len(drafter.vocab) if drafter.vocab is not None else None) != cfg.draft_vocab:
        raise Hf2qError(
            f"{out} holds a run with another --draft-vocab; use another --out or the same options"
        )
    return drafter, state


def new_drafter(target, cfg: TrainConfig, rows: Sequence[dict]) -> tuple[Drafter, dict]:
    """A fresh drafter for ``cfg`` (its draft vocabulary, if any, ranked on the
    training answers only, the held-out ones excluded) and an empty state."""
    drafter = drafter_for(
        target,
        layers=cfg.layers,
        target_layer_ids=cfg.target_layer_ids,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        seed=cfg.seed,
        warm_start=cfg.warm_start,
    )
    if cfg.draft_vocab is not None:
        usable = [r["tokens"] for r in rows if len(r["tokens"]) - r["prompt_tokens"] >= 2]
        drafter.vocab = frequency_vocab(usable[cfg.holdout :], cfg.draft_vocab, drafter.config.vocab_size)
    return drafter, {"step": 0, "history": []}


def train_sequences(
    target, rows: Sequence[dict], layer_ids: Sequence[int], hidden_weight: float
) -> list[TrainSequence]:
    """The rows with at least two answer tokens, with their features: the
    row's ``"captured"`` pass when taken at ``layer_ids``, else a target pass
    (final states kept only when ``hidden_weight`` is non-zero)."""
    seqs = []
    for r in rows:
        toks = r["tokens"]
        if len(toks) - r["prompt_tokens"] < 2:
            continue
        cap = r.get("captured")  # taken during generation (dflash_data.self_distill)
        if cap is not None and list(cap.layer_ids) == list(layer_ids):
            feats, agrees, finals = cap.features, cap.agrees, cap.finals
        else:
            feats, agrees, finals = target_pass(target, toks, layer_ids)
        seqs.append(
            TrainSequence(
                mx.array(toks, dtype=mx.int32),
                feats,
                r["prompt_tokens"] - 1,
                agrees,
                finals if hidden_weight else None,
            )
        )
    return seqs


def optimizer(cfg: TrainConfig, drafter: Drafter, resume_from: Path | None) -> optim.AdamW:
    """AdamW with a linear warmup and cosine decay; its state read back from
    ``resume_from`` (a run's state folder) when saved there."""
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr * 0.01, cfg.lr, cfg.warmup),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - cfg.warmup), cfg.lr * 0.05),
        ],
        [cfg.warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    if resume_from is not None and (resume_from / "optimizer.safetensors").is_file():
        opt.init(drafter.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(resume_from / "optimizer.safetensors")).items()))
    return opt


def held_out_mal(drafter: Drafter, head: TargetHead, held: Sequence[TrainSequence]) -> float:
    """Mean accepted length over 32 fixed random anchors of each held-out
    sequence (NaN when none has any)."""
    rng = random.Random(1234)
    lengths = []
    for s in held:
        a = _anchors(rng, s, 32)
        if a is not None:
            lengths.append(accepted_lengths(drafter, head, s, a))
    return mx.concatenate(lengths).astype(mx.float32).mean().item() if lengths else float("nan")


def step_anchors(rng: random.Random, seq: TrainSequence, cfg: TrainConfig) -> mx.array | None:
    """One step's block anchors in ``seq``: in its answer, and a
    ``prompt_anchors`` share anywhere after the first token (None: no room)."""
    n_prompt = int(cfg.anchors * cfg.prompt_anchors)
    parts = [
        x
        for x in (_anchors(rng, seq, cfg.anchors - n_prompt), _anchors(rng, seq, n_prompt, start=1))
        if x is not None and x.size
    ]
    return mx.concatenate(parts) if parts else None


@dataclass
class _Run:
    """What one training run works with (see ``train``)."""

    target: Any
    cfg: TrainConfig
    drafter: Drafter
    head: TargetHead
    opt: optim.AdamW
    state: dict  # {"step", "history", "config"}: trainer.json
    work: Path  # the run's state folder
    log: Callable[[str], None]

    def evaluate(self, held: Sequence[TrainSequence], step: int, loss: float, t0: float) -> float:
        """The held-out MAL now, also added to the run's history (with the
        seconds since ``t0``, the evaluation included)."""
        self.drafter.eval()
        mal = held_out_mal(self.drafter, self.head, held)
        self.drafter.train()
        seconds = time.perf_counter() - t0
        self.state["history"].append(
            {
                "step": step,
                "loss": round(loss, 4),
                "held_out_mal": round(mal, 3),
                "seconds": round(seconds, 1),
            }
        )
        return mal

    def checkpoint(self, step: int, mal: float | None) -> None:
        """Save the drafter in ``cfg.out``, and the optimizer and trainer state."""
        save_drafter(
            self.drafter,
            Path(self.cfg.out),
            extra={"hf2q_training": {"step": step, "held_out_mal": mal, "target": str(self.target.source)}},
        )
        mx.save_safetensors(str(self.work / "optimizer.safetensors"), dict(tree_flatten(self.opt.state)))
        self.state.update(step=step, config=asdict(self.cfg))
        (self.work / "trainer.json").write_text(json.dumps(self.state, indent=1) + "\n")


class _ProgressLine:
    """The progress bar: redrawn in place on a terminal (at most a few times a
    second), else logged at each evaluation."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None]):
        self.cfg, self.log = cfg, log
        self.tty, self.last_draw = sys.stderr.isatty(), 0.0

    def show(self, step: int, loss: float, mal: float | None, sec: float, final: bool) -> None:
        cfg = self.cfg
        line = _progress(step, cfg.steps, loss, mal, sec)
        if self.tty:
            if time.perf_counter() - self.last_draw > 0.25 or step == cfg.steps:
                print(line, end="", file=sys.stderr, flush=True)
                self.last_draw = time.perf_counter()
            if step % cfg.eval_every == 0:
                print(file=sys.stderr)
        elif step % cfg.eval_every == 0 or final:
            self.log(line.strip())

    def end(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def run_steps(
    run: _Run, held: Sequence[TrainSequence], train_seqs: Sequence[TrainSequence], progress: bool
) -> None:
    """The optimisation steps from the run's last one to ``cfg.steps`` (or
    ``cfg.max_minutes``), evaluating and checkpointing as ``cfg`` says."""
    cfg, drafter, state = run.cfg, run.drafter, run.state
    weights = mx.exp(-mx.arange(cfg.block_size - 1, dtype=mx.float32) / cfg.gamma)
    loss_and_grad = nn.value_and_grad(
        drafter, lambda m, s, a: block_loss(m, run.head, s, a, weights, cfg.ce_positions, cfg.hidden_weight)
    )
    drafter.train()
    rng = random.Random(cfg.seed * 1_000_003 + state["step"])
    mal = state["history"][-1]["held_out_mal"] if state["history"] else None
    smooth, t0, step0 = None, time.perf_counter(), state["step"]
    shown = _ProgressLine(cfg, run.log) if progress else None
    for step in range(state["step"] + 1, cfg.steps + 1):
        seq = rng.choice(train_seqs)
        a = step_anchors(rng, seq, cfg)
        if a is None:
            continue
        loss, grads = loss_and_grad(drafter, seq, a)
        run.opt.update(drafter, grads)
        mx.eval(drafter.parameters(), run.opt.state, loss)
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        out_of_time = cfg.max_minutes is not None and time.perf_counter() - t0 > cfg.max_minutes * 60
        final = step == cfg.steps or out_of_time
        if step % cfg.eval_every == 0 or final:
            mal = run.evaluate(held, step, smooth, t0)
        if step % cfg.checkpoint_every == 0 or final:
            run.checkpoint(step, mal)
        if shown is not None:
            shown.show(step, smooth, mal, (time.perf_counter() - t0) / (step - step0), final)
        if out_of_time:
            run.log(
                f"stopped after {cfg.max_minutes:g} minutes at step {step} (resume with the same command)"
            )
            break
    if shown is not None:
        shown.end()
