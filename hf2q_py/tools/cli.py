"""The ``hf2q-py`` command line: ``generate`` (and ``bench``, ``ab``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..errors import Hf2qError, one_line
from .files import check_writable, read_prompts, read_text, write_text
from ..validate import check_unicode

_NO_OPENBLAS_BOOT = (
    "import sys, warnings; "
    "warnings.filterwarnings('ignore', message='hf2q_py: mlx.core was imported'); "
    "import mlx.core; from hf2q_py.tools.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder, HF repo id (local cache) or GGUF file; default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, stored weights on GPU), keep, float32, float16, bfloat16")
    p.add_argument("--no-openblas", action="store_true", help="keep MLX's own BLAS on Linux CPUs (slower; bit-identical batched/single-token matmuls)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="baseline", help="baseline, ngram, draft, layerskip or dflash")
    p.add_argument("--k", type=_positive_int, default=None, help="(maximum) draft length per round (default: 32 for ngram with the suffix proposer, 16 with lookup, 8 otherwise)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--adaptive", dest="adaptive", action="store_true", default=True, help="choose K each round from measured acceptance and cost (default)")
    mode.add_argument("--fixed-k", dest="adaptive", action="store_false", help="always draft up to K tokens")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to look up (n-gram method)")
    p.add_argument("--ngram-max", type=int, default=5, help="longest n-gram to look up (n-gram method, lookup proposer)")
    p.add_argument("--ngram-proposer", default="suffix", choices=("suffix", "lookup"), help="n-gram method: suffix automaton with counts (default) or prompt lookup")
    p.add_argument("--suffix-min-prob", type=float, default=0.1, help="suffix proposer: stop a draft where its estimated probability falls below this")
    p.add_argument("--draft-model", default=None, help="draft model (draft method): folder, HF repo id or GGUF")
    p.add_argument("--draft-p-min", type=float, default=None, help="draft method: end a draft before a token the draft model is less sure of than this (default: SpecConfig.draft_p_min)")
    p.add_argument("--draft-suffix-depth", type=int, default=0, help="draft method: where the context's suffix occurred earlier at least this many tokens deep, copy it (no draft forward) instead of running the draft model; 0: off")
    p.add_argument("--skip-layers", default="auto", help="layer-skip set: auto, alternate, early:N, middle:N or a list like 3,5,7")
    p.add_argument("--drafter", default=None, help="DFlash drafter folder (dflash method)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)


def spec_options(args: argparse.Namespace) -> dict:
    options = dict(
        method=args.method,
        k=args.k,
        adaptive=args.adaptive,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        ngram_proposer=args.ngram_proposer,
        suffix_min_prob=args.suffix_min_prob,
        draft_suffix_depth=args.draft_suffix_depth,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )
    if args.draft_p_min is not None:
        options["draft_p_min"] = args.draft_p_min
    if args.method == "draft":
        options["draft"] = args.draft_model  # the path is checked; the CLI loads it with --dtype
    if args.method == "layerskip":
        options["skip_layers"] = args.skip_layers
    if args.method == "dflash":
        options["drafter"] = args.drafter
    return options


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise Hf2qError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        text = read_text(args.prompt_file, "prompt file")
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise Hf2qError("give a prompt with --prompt TEXT or --prompt-file FILE")
    check_unicode(text)
    if not text.strip():
        raise Hf2qError("the prompt is empty")
    return text


def check_drafter_folder(path: str | None) -> None:
    """A --drafter that is not a folder is refused before any model loads."""
    if path is not None and not os.path.isdir(os.path.expanduser(path)):
        raise Hf2qError(f"--drafter {path}: no such folder")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf2q-py", description="Speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--max-tokens", type=_positive_int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_spec_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--profile", action="store_true", help="print one line per round to stderr")

    a = sub.add_parser("ab", help="compare methods with plain greedy decoding token by token")
    add_model_args(a)
    a.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft, layerskip, dflash, mlx-lm-draft")
    a.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    a.add_argument("--prompt-file", default=None, help="a file holding one prompt")
    a.add_argument("--prompts", default=None, help='JSONL file: one prompt per line, a string or {"prompt": ...}')
    a.add_argument("--max-tokens", type=_positive_int, default=128)
    a.add_argument("--k", type=_positive_int, default=4)
    a.add_argument("--draft-model", default=None, help="draft model for draft and mlx-lm-draft")
    a.add_argument("--skip-layers", default="auto")
    a.add_argument("--drafter", default=None, help="DFlash drafter folder for dflash")
    a.add_argument("--no-chat-template", action="store_true")
    a.add_argument("--json", action="store_true", help="print the results as JSON")
    a.add_argument("--markdown", default=None, help="also write the table to this file")

    b = sub.add_parser("bench", help="methods vs plain decoding on real workloads (Markdown table)")
    add_model_args(b)
    b.add_argument("--methods", default="ngram", help="comma-separated; options after ':' e.g. 'ngram:k=4,fixed' (separate methods with ';' when using options)")
    b.add_argument("--max-tokens", type=_positive_int, default=256)
    b.add_argument("--repeats", type=_positive_int, default=1)
    b.add_argument("--temp", type=float, default=0.0, help="sampling temperature for every run (0: greedy)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--only", default=None, help="run only workloads whose name contains this text (or one of several, comma-separated)")
    b.add_argument("--markdown", default=None, help="also write the table to this file")
    b.add_argument("--chart", default=None, help="write a PNG chart here (needs matplotlib)")

    t = sub.add_parser("train-dflash", help="train a DFlash block drafter for a model by self-distillation")
    t.add_argument("--target", default=None, help="target model (as --model); default: the built-in model")
    t.add_argument("--dtype", default="auto", help="target dtype (as for generate)")
    t.add_argument("--out", required=True, help="drafter folder to write (and resume from); must be new, empty or an earlier train-dflash run")
    t.add_argument("--overwrite", action="store_true", help="start a new run in --out, deleting its config.json, *.safetensors and earlier run state")
    t.add_argument("--prompts", default=None, help="prompt file (JSONL or one per line); default: built-in code-editing set")
    t.add_argument("--samples", type=_positive_int, default=240, help="prompts the target answers for training data")
    t.add_argument("--max-new-tokens", type=_positive_int, default=256, help="length of each answer")
    t.add_argument("--layers", type=_positive_int, default=2, help="drafter decoder layers")
    t.add_argument("--block-size", type=int, default=8, help="tokens per block (last token + masks); drafts per round = block-size - 1")
    t.add_argument("--target-layers", default=None, help="target layer ids to condition on, e.g. 1,14,27 (default: 3 spread)")
    t.add_argument("--mask-token-id", type=int, default=None, help="token id used as the mask (default: the last id)")
    t.add_argument("--steps", type=_positive_int, default=3000)
    t.add_argument("--anchors", type=_positive_int, default=16, help="blocks per step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--ce-positions", type=int, default=3, help="block positions trained with cross-entropy through the head (-1: all)")
    t.add_argument("--hidden-weight", type=float, default=1.0, help="weight of the final-state regression on every block position")
    t.add_argument("--holdout", type=int, default=16, help="sequences kept out of training for the acceptance estimate")
    t.add_argument("--eval-every", type=_positive_int, default=250)
    t.add_argument("--checkpoint-every", type=_positive_int, default=250)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-minutes", type=float, default=None, help="stop training after this long, with a checkpoint")
    t.add_argument("--no-openblas", action="store_true", help=argparse.SUPPRESS)
    return parser


def cmd_train_dflash(args: argparse.Namespace) -> int:
    import hf2q_py
    from hf2q_py.tools.dflash_data import default_prompts, self_distill
    from hf2q_py.tools.dflash_train import TrainConfig, prepare_out, run_record, train
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype

    layer_ids = None
    if args.target_layers is not None:
        try:
            layer_ids = [int(x) for x in args.target_layers.split(",") if x.strip()]
        except ValueError:
            raise Hf2qError(f"--target-layers must be comma-separated integers, got {args.target_layers!r}") from None
    cfg = TrainConfig(
        out=args.out, layers=args.layers, block_size=args.block_size, target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id, samples=args.samples, max_new_tokens=args.max_new_tokens,
        steps=args.steps, anchors=args.anchors, lr=args.lr, holdout=args.holdout, eval_every=args.eval_every,
        ce_positions=None if args.ce_positions == -1 else args.ce_positions, hidden_weight=args.hidden_weight,
        checkpoint_every=args.checkpoint_every, seed=args.seed, max_minutes=args.max_minutes,
        overwrite=args.overwrite,
    )
    cfg.validate()
    parse_dtype(args.dtype)
    check_source(args.target)
    prompts = read_prompts(args.prompts) if args.prompts else default_prompts(args.samples, seed=args.seed)
    if len(prompts) < args.samples:
        raise Hf2qError(f"--samples {args.samples} but only {len(prompts)} prompts")
    prompts = prompts[: args.samples]
    data = prepare_out(cfg, run_record(args.target, prompts, args.max_new_tokens))  # before the slow load
    target = hf2q_py.load(args.target, dtype=args.dtype)
    cfg.check_target(target)  # before the slow data generation
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = self_distill(target, prompts, data, max_new_tokens=args.max_new_tokens, log=log)
    train(target, cfg, rows, log=log)
    print(f"drafter written to {args.out} (use: hf2q-py generate --method dflash --drafter {args.out})")
    return 0


def split_methods(text: str) -> list[str]:
    """'a;b:k=2,fixed' or 'a,b' (the latter only when no method has options)."""
    if ";" in text or ":" in text:
        return [m for m in (x.strip() for x in text.split(";")) if m]
    return [m for m in (x.strip() for x in text.split(",")) if m]


def cmd_bench(args: argparse.Namespace) -> int:
    import hf2q_py
    from hf2q_py.tools.bench import markdown_table, parse_method, run_bench, save_chart, timestamp
    from hf2q_py.generation import make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype
    from hf2q_py.tools.workloads import default_workloads

    methods = [parse_method(m) for m in split_methods(args.methods) if m != "baseline"]
    if not methods:
        raise Hf2qError("--methods names no method to compare with the baseline")
    common = {"temperature": args.temp, "seed": args.seed} if args.temp != 0 else {}
    for m in methods:  # every option is checked before the model loads
        make_config(max_tokens=args.max_tokens, **common, **m.options)
        if "draft" in m.options:
            check_source(m.options["draft"])
        check_drafter_folder(m.options.get("drafter"))
    only = [x for x in (args.only or "").split(",") if x]
    workloads = [w for w in default_workloads() if not only or any(x in w.name for x in only)]
    if not workloads:
        raise Hf2qError(f"no workload matches --only {args.only!r}")
    for path, what in ((args.markdown, "--markdown file"), (args.chart, "--chart file")):
        if path:
            check_writable(path, what)
    parse_dtype(args.dtype)
    check_source(args.model)
    target = hf2q_py.load(args.model, dtype=args.dtype)
    drafts = {}
    for m in methods:  # draft models load with --dtype, once each
        src = m.options.get("draft")
        if isinstance(src, str):
            if src not in drafts:
                drafts[src] = hf2q_py.load(src, dtype=args.dtype)
            m.options["draft"] = drafts[src]
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = run_bench(target, workloads, methods, max_tokens=args.max_tokens, repeats=args.repeats,
                     common=common, log=log)
    table = markdown_table(rows)
    header = (
        f"hf2q-py bench, {timestamp()}: model {target.source}, dtype {args.dtype}, "
        f"max_tokens {args.max_tokens}, repeats {args.repeats}, temperature {args.temp}, OpenBLAS {hf2q_py.openblas_status().state}\n"
    )
    print(header)
    print(table)
    if args.markdown:
        write_text(args.markdown, header + "\n" + table + "\n", "--markdown file")
    if args.chart and not save_chart(rows, args.chart):
        print("hf2q-py: matplotlib is not installed; no chart written (pip install 'hf2q-py[chart]')", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    import hf2q_py
    from hf2q_py.generation import encode_prompt, make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype

    # every option is checked before the model loads
    config = make_config(
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        chat_template=not args.no_chat_template,
        **spec_options(args),
    )
    parse_dtype(args.dtype)
    check_source(args.model)
    if args.method == "draft":
        check_source(args.draft_model)
    if args.method == "dflash":
        check_drafter_folder(args.drafter)
    target = hf2q_py.load(args.model, dtype=args.dtype)
    if args.method == "draft":
        config.spec.draft = hf2q_py.load(args.draft_model, dtype=args.dtype)
    ids = encode_prompt(target, prompt, config.chat_template)
    on_round = None
    if args.profile:

        def on_round(r):
            print(
                f"round {r.index:4d}  k={r.k:2d} drafted={r.drafted:2d} accepted={r.accepted:2d} "
                f"emitted={r.emitted:2d}  propose {r.propose_seconds * 1e3:7.2f} ms  "
                f"verify {r.verify_seconds * 1e3:7.2f} ms  sample {r.sample_seconds * 1e3:6.2f} ms",
                file=sys.stderr,
            )

    if args.json:
        result = hf2q_py.generate(target, ids, on_round=on_round, config=config)
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "prompt_tokens": len(result.prompt_tokens),
                    "finish_reason": result.finish_reason,
                    "stats": result.stats.to_dict(),
                }
            )
        )
        return 0
    stats = None
    for chunk in hf2q_py.stream_generate(target, ids, on_round=on_round, config=config):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        stats = chunk.stats
    sys.stdout.write("\n")
    if stats is not None:
        print(f"[{args.method}] {stats.summary()}", file=sys.stderr)
    return 0


def read_ab_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts.append(read_text(args.prompt_file, "prompt file"))
    if args.prompts:
        prompts += read_prompts(args.prompts)
    if not prompts:
        from hf2q_py.tools.workloads import default_workloads

        prompts = [w.prompt for w in default_workloads()]
    for p in prompts:
        check_unicode(p)
    if any(not p.strip() for p in prompts):
        raise Hf2qError("a prompt is empty")
    return prompts


AB_METHODS = ("ngram", "draft", "layerskip", "dflash", "mlx-lm-draft")


def cmd_ab(args: argparse.Namespace) -> int:
    import hf2q_py
    from hf2q_py.tools.ab import run_ab, table
    from hf2q_py.config import check_skip_layers
    from hf2q_py.draft_length import validate_k
    from hf2q_py.generation import encode_prompt
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in names:
        if m not in AB_METHODS:
            raise Hf2qError(f"unknown method {m!r} for ab; choose from {', '.join(sorted(AB_METHODS))}")
    if not names:
        raise Hf2qError("--methods is empty")
    validate_k(args.k)
    needs_draft = {"draft", "mlx-lm-draft"} & set(names)
    if needs_draft and not args.draft_model:
        raise Hf2qError(f"{', '.join(sorted(needs_draft))} needs --draft-model")
    if "dflash" in names and not args.drafter:
        raise Hf2qError("dflash needs --drafter")
    if "layerskip" in names:
        check_skip_layers(args.skip_layers)
    prompts = read_ab_prompts(args)
    if args.markdown:
        check_writable(args.markdown, "--markdown file")
    parse_dtype(args.dtype)
    check_source(args.model)
    if needs_draft:
        check_source(args.draft_model)
    if "dflash" in names:
        check_drafter_folder(args.drafter)
    target = hf2q_py.load(args.model, dtype=args.dtype)
    draft = hf2q_py.load(args.draft_model, dtype=args.dtype) if needs_draft else None
    methods = []
    for m in names:
        if m == "ngram":
            methods.append((m, dict(method="ngram", k=args.k)))
        elif m == "draft":
            methods.append((m, dict(method="draft", draft=draft, k=args.k)))
        elif m == "layerskip":
            methods.append((m, dict(method="layerskip", skip_layers=args.skip_layers, k=args.k)))
        elif m == "dflash":
            methods.append((m, dict(method="dflash", drafter=args.drafter, k=args.k)))
        else:
            methods.append((m, dict(draft=draft, k=args.k)))
    if draft is not None:
        from hf2q_py.proposers.draft_model import check_compatible

        check_compatible(target, draft)  # mlx-lm-draft too: it has no check of its own
    encoded = [(p, encode_prompt(target, p, not args.no_chat_template)) for p in prompts]
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results, noise = run_ab(target, encoded, methods, max_tokens=args.max_tokens, log=log)
    mismatches = sum(r.verdict == "MISMATCH" for r in results)
    summary = (
        f"near-tie bound {noise.bound:.3g}: 2 x the largest |batched - single-token| logit difference "
        f"({noise.max_logit_diff:.3g}) measured over {noise.positions} positions; "
        f"{sum(r.verdict == 'identical' for r in results)} identical, "
        f"{sum(r.verdict == 'near-tie' for r in results)} near-tie, {mismatches} MISMATCH"
    )
    text = table(results)
    if args.json:
        print(json.dumps({"noise": noise.__dict__, "results": [r.to_dict() for r in results]}))
    else:
        print(text)
        print()
        print(summary)
    if args.markdown:
        write_text(args.markdown, text + "\n\n" + summary + "\n", "--markdown file")
    return 1 if mismatches else 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "ab": cmd_ab, "train-dflash": cmd_train_dflash}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "no_openblas", False) and "mlx.core" not in sys.modules:
        # OpenBLAS is loaded when hf2q_py is imported; restart with mlx.core first.
        os.execv(sys.executable, [sys.executable, "-c", _NO_OPENBLAS_BOOT, *argv])
    try:
        return COMMANDS[args.command](args)
    except Hf2qError as e:
        print(f"hf2q-py: error: {one_line(e, limit=1000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf2q-py: interrupted", file=sys.stderr)
        return 130

if __name__ == "__main__":
    sys.exit(main())
