"""The ``hf2q-py`` command line: ``generate`` (and ``bench``, ``ab``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Sequence

from ..errors import Hf2qError, one_line
from .files import check_writable, read_prompts, read_text, write_text
from ..validate import check_unicode

if TYPE_CHECKING:
    from .dflash_train import TrainConfig

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
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF file, a model folder, or a Hugging Face hub model: owner/name, owner/name:QUANT "
        "(a GGUF quantization, e.g. :Q4_K_M) or owner/name/file.gguf, downloaded once into the HF cache; "
        "default: the built-in SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (float32 on CPU, stored weights on GPU), keep, float32, float16, bfloat16",
    )
    p.add_argument(
        "--shard",
        default="auto",
        choices=("auto", "tensor", "pipeline", "none"),
        help="under mlx.launch: split the model over the ranks by tensor or pipeline "
        "(auto: tensor where the architecture has it), or none (each rank runs it whole)",
    )
    p.add_argument(
        "--no-openblas",
        action="store_true",
        help="keep MLX's own BLAS on Linux CPUs (slower; bit-identical batched/single-token matmuls)",
    )
    add_kv_args(p)
    add_hub_args(p)


def add_kv_args(p: argparse.ArgumentParser) -> None:
    """``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``: the KV caches' storage."""
    p.add_argument(
        "--kv-bits",
        type=_choice_int((4, 8)),
        default=None,
        metavar="{4,8}",
        help="quantize the KV caches to 8 or 4 bits (about 0.53x / 0.28x the bytes of 16-bit KV); "
        "default: full precision",
    )
    p.add_argument(
        "--kv-group-size",
        type=_choice_int((32, 64, 128)),
        default=None,
        metavar="{32,64,128}",
        help="elements of the head dimension per scale and bias (default 64; with --kv-bits)",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=_nonnegative_int,
        default=None,
        metavar="N",
        help="positions below N stay at full precision until the sequence reaches N (default 0; with --kv-bits)",
    )


def kv_options(args: argparse.Namespace) -> dict:
    """The KV flags as ``hf2q_py.load`` options (a group size or start needs --kv-bits)."""
    if args.kv_bits is None:
        for flag, value in (
            ("--kv-group-size", args.kv_group_size),
            ("--quantized-kv-start", args.quantized_kv_start),
        ):
            if value is not None:
                raise Hf2qError(f"{flag} applies to a quantized KV cache: give --kv-bits 8 or 4 too")
    return {
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "quantized_kv_start": args.quantized_kv_start,
    }


def _choice_int(choices: tuple[int, ...]):
    """An argparse type: one of the integers ``choices``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value not in choices:
            named = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
            raise argparse.ArgumentTypeError(f"must be {named}, got {text!r}")
        return value

    convert.__name__ = "int"
    return convert


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_hub_args(p: argparse.ArgumentParser) -> None:
    """``--offline`` and ``--progress``: how hub models are fetched and loads shown."""
    p.add_argument(
        "--offline",
        action="store_true",
        help="load hub models from the Hugging Face cache only, never download (as HF_HUB_OFFLINE=1)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars on stderr while downloading and loading "
        "(default: when stderr is a terminal, and not with --json)",
    )


def load_options(args: argparse.Namespace) -> dict:
    """``offline`` and ``progress`` for ``hf2q_py.load`` from the flags
    (``--json`` keeps stderr quiet unless ``--progress`` is given)."""
    progress = args.progress
    if progress is None and getattr(args, "json", False):
        progress = False
    return {"offline": args.offline, "progress": progress}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        help=f"{METHOD_SPEC_HELP} (default: {DEFAULT_METHOD}; baseline: plain decoding)",
    )
    add_method_flags(p)
    add_sampling_args(p)


#: What ``generate`` speculates with unless told: n-gram drafting costs a few
#: percent at most where it finds nothing to copy.
DEFAULT_METHOD = "ngram"
METHOD_SPEC_HELP = (
    "a method spec NAME[:key=value,flag,...], NAME one of baseline, ngram, draft, layerskip, dflash; "
    "e.g. 'ngram:k=8,fixed' or 'layerskip:skip_layers=[3,5,7]'"
)


def add_method_flags(p: argparse.ArgumentParser, note: str = "") -> None:
    """One flag per option of the method table: the method spec's options as
    flags (``--k 8`` is ``:k=8``), for every method that takes them."""
    from ..methods import METHODS, OPTIONS

    for o in OPTIONS.values():
        users = ", ".join(m.name for m in METHODS.values() if o.name in m.options)
        text = f"{o.help} [{users}{note}]"
        if o.kind == "bool":
            group = p.add_mutually_exclusive_group()
            group.add_argument(
                o.cli_flag, dest=o.name, action="store_true", default=argparse.SUPPRESS, help=text
            )
            group.add_argument(
                o.cli_off_flag,
                dest=o.name,
                action="store_false",
                default=argparse.SUPPRESS,
                help=f"{o.name} off (as {o.name}=no)",
            )
        else:
            metavar = {"int": "N", "float": "X", "choice": "{" + ",".join(o.choices) + "}"}.get(
                o.kind, o.name.upper()
            )
            p.add_argument(
                o.cli_flag,
                dest=o.name,
                type=_option_type(o),
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=text,
            )


def _option_type(option):
    from ..method_spec import parse_value

    def convert(text: str):
        try:
            value = parse_value(option, text)
            option.check(value)
        except Hf2qError as e:
            raise argparse.ArgumentTypeError(one_line(e)) from None
        return value

    convert.__name__ = option.kind  # argparse names the type in its messages
    return convert


def flag_options(args: argparse.Namespace) -> dict:
    """The method options given as flags."""
    from ..methods import OPTIONS

    return {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)


def sampling_options(args: argparse.Namespace) -> dict:
    return dict(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )


def parse_command_methods(text: str, args: argparse.Namespace, defaults: dict | None = None):
    """The method specs of ``--method``/``--methods`` with the option flags
    (and the command's ``defaults``) filled in where a spec leaves them out."""
    from ..method_spec import fill_options, parse_methods

    return fill_options(parse_methods(text), flag_options(args), defaults)


def check_sources(specs, offline: bool = False) -> None:
    """Draft models and drafters named by the methods exist (before any load or download)."""
    from hf2q_py.loaders import check_source

    for s in specs:
        if isinstance(s.options.get("draft"), str):
            check_source(s.options["draft"], offline=offline)
        if isinstance(s.options.get("drafter"), str):
            check_drafter_folder(s.options["drafter"], offline=offline)


def load_target(args: argparse.Namespace):
    """The ``--model`` target (downloaded first if it is a hub model not in the
    cache), sharded by ``--shard`` over the ``mlx.launch`` group if any."""
    import hf2q_py
    from hf2q_py.distributed import launched_group

    group = launched_group()
    options = {**load_options(args), **kv_options(args)}
    if group is None:
        return hf2q_py.load(args.model, dtype=args.dtype, **options)
    return hf2q_py.load(args.model, dtype=args.dtype, group=group, shard=args.shard, **options)


def sharding_fields(target) -> dict:
    """``ranks`` and ``shard`` for JSON output and results files."""
    sh = target.sharding
    return {"ranks": sh.size if sh is not None else 1, "shard": sh.mode if sh is not None else "none"}


def load_drafts(specs, dtype: str, offline: bool = False, progress: bool | None = None) -> None:
    """Replace draft model sources by the loaded models (with ``dtype``, once
    each), and hub drafters by their downloaded folders."""
    import hf2q_py
    from hf2q_py.proposers.dflash_drafter import drafter_folder

    loaded = {}
    for s in specs:
        src = s.options.get("draft")
        if isinstance(src, str):
            if src not in loaded:
                loaded[src] = hf2q_py.load(src, dtype=dtype, offline=offline, progress=progress)
            s.options["draft"] = loaded[src]
        if isinstance(s.options.get("drafter"), str):
            s.options["drafter"] = str(
                drafter_folder(s.options["drafter"], offline=offline, progress=progress)
            )


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


def check_drafter_folder(path: str | None, offline: bool = False) -> None:
    """A --drafter that is neither a folder nor a hub repo is refused before any model loads."""
    if path is None or os.path.isdir(os.path.expanduser(path)):
        return
    from hf2q_py.loaders.hub import HubName, check, parse_source
    from hf2q_py.proposers.dflash_drafter import DRAFTER_FILES

    try:
        found = parse_source(path)
    except Hf2qError:
        found = None
    if not isinstance(found, HubName) or found.quant is not None or found.file is not None:
        raise Hf2qError(f"--drafter {path}: no such folder, and not a hub repo (owner/name)")
    try:
        check(path, offline=offline, patterns=DRAFTER_FILES)
    except Hf2qError as e:
        raise Hf2qError(f"--drafter: {e}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``hf2q-py`` parser: one subcommand per entry of ``COMMANDS``."""
    from hf2q_py import __version__

    parser = _Parser(prog="hf2q-py", description="Speculative decoding on MLX.")
    parser.add_argument("--version", action="version", version=f"hf2q-py {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_generate_parser(sub)
    add_ab_parser(sub)
    add_bench_parser(sub)
    add_train_dflash_parser(sub)
    add_serve_parser(sub)
    return parser


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``hf2q-py generate``."""
    g = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--max-tokens", type=_positive_int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_constraint_args(g)
    add_spec_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--profile", action="store_true", help="print one line per round to stderr")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output: what the generated text must match (one of these)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", default=None, metavar="FILE_OR_JSON", help="a JSON schema the output follows"
    )
    group.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    group.add_argument("--regex", default=None, help="a regular expression the whole output matches")
    group.add_argument(
        "--grammar",
        default=None,
        metavar="FILE_OR_TEXT",
        help="a Lark grammar (llguidance's) the output follows",
    )


def constraint_options(args: argparse.Namespace) -> dict:
    """The constraint flags as generation options (schema and grammar files read)."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = read_text(text, "--json-schema file")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise Hf2qError(f"--json-schema: not valid JSON ({e})") from None
        return {"json_schema": schema}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        text = args.grammar
        if os.path.isfile(os.path.expanduser(text)):
            text = read_text(os.path.expanduser(text), "--grammar file")
        return {"grammar": text}
    return {}


def add_ab_parser(sub: argparse._SubParsersAction) -> None:
    """``hf2q-py ab``."""
    a = sub.add_parser(
        "ab", help="compare methods, other engines or recorded outputs with plain greedy decoding"
    )
    add_model_args(a)
    a.add_argument(
        "--methods",
        default=None,
        help="method specs as for generate --method, separated by ';' "
        "(or ',' when none has options); also mlx-lm-draft[:draft=PATH,k=N], mlx-lm's own speculative "
        "decoding, and the engines mlx-lm (its greedy decoding of the same weights) and llama.cpp "
        "(llama-cpp-python on the same GGUF); default: ngram, or none with --reference/--record",
    )
    a.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    a.add_argument("--prompt-file", default=None, help="a file holding one prompt")
    a.add_argument(
        "--prompts", default=None, help='JSONL file: one prompt per line, a string or {"prompt": ...}'
    )
    a.add_argument(
        "--reference",
        default=None,
        metavar="FILE",
        help="JSONL file of another engine's outputs (docs/ab-checks.md): its prompts, compared "
        "with plain greedy decoding token by token (or byte by byte for text)",
    )
    a.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="write plain greedy decoding's outputs to FILE in the reference format",
    )
    a.add_argument(
        "--reference-bound",
        type=float,
        default=None,
        metavar="X",
        help="near-tie bound (logits) for --reference cases; default: 10 x the measured noise bound",
    )
    a.add_argument(
        "--max-tokens", type=_positive_int, default=None, help="default 128 (not with --reference)"
    )
    add_method_flags(a, note="; ab: k defaults to 4")
    a.add_argument("--no-chat-template", action="store_true")
    a.add_argument("--json", action="store_true", help="print the results as JSON")
    a.add_argument("--markdown", default=None, help="also write the table to this file")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``hf2q-py bench``."""
    b = sub.add_parser("bench", help="methods vs plain decoding on real workloads (Markdown table)")
    add_model_args(b)
    b.add_argument(
        "--methods",
        default="ngram",
        help="method specs as for generate --method, separated by ';' "
        "(or ',' when none has options), e.g. 'ngram;ngram:k=4,fixed'",
    )
    add_method_flags(b)
    b.add_argument("--max-tokens", type=_positive_int, default=256)
    b.add_argument("--repeats", type=_positive_int, default=1)
    b.add_argument("--temp", type=float, default=0.0, help="sampling temperature for every run (0: greedy)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--only",
        default=None,
        help="run only workloads whose name contains this text (or one of several, comma-separated)",
    )
    b.add_argument("--markdown", default=None, help="also write the table to this file")
    b.add_argument(
        "--results",
        default=None,
        help="also write a results file (JSON: command, date, machine, "
        "commit, tables, rows) for python -m hf2q_py.tools.tables",
    )
    b.add_argument("--chart", default=None, help="write a PNG chart here (needs matplotlib)")


def add_train_dflash_parser(sub: argparse._SubParsersAction) -> None:
    """``hf2q-py train-dflash``: the run and its data, the drafter's shape,
    the training."""
    t = sub.add_parser("train-dflash", help="train a DFlash block drafter for a model by self-distillation")
    t.add_argument("--target", default=None, help="target model (as --model); default: the built-in model")
    t.add_argument("--dtype", default="auto", help="target dtype (as for generate)")
    add_hub_args(t)
    t.add_argument(
        "--out",
        required=True,
        help="drafter folder to write (and resume from); must be new, empty or an earlier train-dflash run",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in --out, deleting its config.json, *.safetensors and earlier run state",
    )
    t.add_argument(
        "--prompts",
        default=None,
        help="prompt file (JSONL or one per line); default: built-in code-editing set",
    )
    t.add_argument(
        "--samples", type=_positive_int, default=240, help="prompts the target answers for training data"
    )
    t.add_argument("--max-new-tokens", type=_positive_int, default=256, help="length of each answer")
    _add_drafter_shape_args(t)
    _add_training_args(t)
    t.add_argument("--no-openblas", action="store_true", help=argparse.SUPPRESS)


def _add_drafter_shape_args(t: argparse.ArgumentParser) -> None:
    """train-dflash: the new drafter's layers, block and conditioning."""
    t.add_argument("--layers", type=_positive_int, default=2, help="drafter decoder layers")
    t.add_argument(
        "--block-size",
        type=int,
        default=8,
        help="tokens per block (last token + masks); drafts per round = block-size - 1",
    )
    t.add_argument(
        "--target-layers",
        default=None,
        help="target layer ids to condition on, e.g. 1,14,27 (default: 3 spread)",
    )
    t.add_argument(
        "--mask-token-id", type=int, default=None, help="token id used as the mask (default: the last id)"
    )


def _add_training_args(t: argparse.ArgumentParser) -> None:
    """train-dflash: steps, losses, evaluation, checkpoints, and the drafter's
    vocabulary and start."""
    t.add_argument("--steps", type=_positive_int, default=3000)
    t.add_argument("--anchors", type=_positive_int, default=16, help="blocks per step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument(
        "--ce-positions",
        type=int,
        default=3,
        help="block positions trained with cross-entropy through the head (-1: all)",
    )
    t.add_argument(
        "--hidden-weight",
        type=float,
        default=1.0,
        help="weight of the final-state regression on every block position",
    )
    t.add_argument(
        "--holdout", type=int, default=16, help="sequences kept out of training for the acceptance estimate"
    )
    t.add_argument("--eval-every", type=_positive_int, default=250)
    t.add_argument("--checkpoint-every", type=_positive_int, default=250)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--max-minutes", type=float, default=None, help="stop training after this long, with a checkpoint"
    )
    t.add_argument(
        "--draft-vocab",
        type=_positive_int,
        default=None,
        help="draft only among the N most frequent tokens of the training answers (default: the whole vocabulary)",
    )
    t.add_argument(
        "--warm-start",
        action="store_true",
        help="start the drafter layers as copies of the target's last layers",
    )
    t.add_argument(
        "--gen-batch", type=_positive_int, default=8, help="answers decoded at a time for the training data"
    )


def _byte_size(text: str) -> int:
    """A size in bytes: 1000000, 512MiB, 2GiB, 64KiB (also KB, MB, GB)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)] if unit else t) * units.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512MiB or 2GiB, got {text!r}") from None
    if not value >= 1 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return int(value)


def _memory_size(text: str) -> int:
    """A memory budget: 12GB, 12GiB, 640MB or bytes (``hf2q_py.budget.parse_size``)."""
    from hf2q_py.budget import parse_size

    try:
        return parse_size(text, "size")
    except Hf2qError as e:
        raise argparse.ArgumentTypeError(one_line(e).removeprefix("size: ")) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535] (0: any free port), got {value}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve", help="an HTTP server: OpenAI's chat/text completions and Responses, Anthropic's Messages"
    )
    add_model_args(s)
    s.add_argument(
        "--method", default="ngram", help=f"the default method: {METHOD_SPEC_HELP} (default: ngram)"
    )
    add_method_flags(s)
    _add_serve_limits(s)
    _add_serve_memory(s)
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request")


def _add_serve_limits(s: argparse.ArgumentParser) -> None:
    """Where serve listens, its key, and what one request may ask."""
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)"
    )
    s.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0: any free port)")
    s.add_argument(
        "--api-key", default=None, help="require Authorization: Bearer KEY on every endpoint but /health"
    )
    s.add_argument("--api-key-file", default=None, help="as --api-key, the key read from this file")
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: --model as given for a hub model, "
        "else the file's name without .gguf or the folder's name)",
    )
    s.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=512,
        help="max_tokens when a request gives none (default 512)",
    )
    s.add_argument(
        "--max-context",
        type=_positive_int,
        default=None,
        help="prompt plus answer tokens at most (default: the model's context)",
    )
    s.add_argument(
        "--max-body-bytes", type=_byte_size, default=8 << 20, help="largest request body (default 8MiB)"
    )
    s.add_argument(
        "--max-queue",
        type=_positive_int,
        default=16,
        help="requests that may wait for the model; more get 503 (default 16)",
    )
    s.add_argument(
        "--max-batch",
        type=_positive_int,
        default=8,
        help="generations running at once, sharing each forward (continuous batching; default 8; 1: one at a time)",
    )
    s.add_argument(
        "--temp", type=float, default=0.0, help="temperature when a request gives none (default 0: greedy)"
    )


def _add_serve_memory(s: argparse.ArgumentParser) -> None:
    """serve's prompt cache (memory and disk) and its memory budget."""
    s.add_argument(
        "--prompt-cache-entries",
        type=_positive_int,
        default=8,
        help="model states kept for prompt reuse (default 8)",
    )
    s.add_argument(
        "--prompt-cache-bytes",
        type=_byte_size,
        default=2 << 30,
        help="memory those states may hold (default 2GiB)",
    )
    s.add_argument("--no-prompt-cache", action="store_true", help="prefill every prompt whole")
    s.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="folder of the prompt cache on disk, which outlives the server "
        "(default: hf2q-py/prompt-cache in the user's cache folder)",
    )
    s.add_argument(
        "--prompt-cache-disk-bytes",
        type=_byte_size,
        default=8 << 30,
        help="bytes the prompt cache on disk may hold, least recently used out (default 8GiB)",
    )
    s.add_argument(
        "--no-disk-cache", action="store_true", help="keep the prompt cache in memory only (lost at exit)"
    )
    s.add_argument(
        "--memory-budget",
        type=_memory_size,
        default=None,
        help="what the server may hold in all: weights, every request's KV, the prompt cache, activations "
        "(12GB, 12GiB, 640MB or bytes; default: the device's recommended working set, on a CPU 80%% of "
        "physical memory, less 10%%)",
    )
    s.add_argument(
        "--memory-queue",
        type=_nonnegative_int,
        default=8,
        help="requests that may wait for memory; more get 429 (default 8)",
    )


def cmd_train_dflash(args: argparse.Namespace) -> int:
    import hf2q_py
    from hf2q_py.tools.dflash_data import default_prompts, self_distill
    from hf2q_py.tools.dflash_train import prepare_out, run_record, train
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype

    cfg = train_config(args)
    cfg.validate()
    parse_dtype(args.dtype)
    check_source(args.target, offline=args.offline)
    prompts = read_prompts(args.prompts) if args.prompts else default_prompts(args.samples, seed=args.seed)
    if len(prompts) < args.samples:
        raise Hf2qError(f"--samples {args.samples} but only {len(prompts)} prompts")
    prompts = prompts[: args.samples]
    data = prepare_out(cfg, run_record(args.target, prompts, args.max_new_tokens))  # before the slow load
    target = hf2q_py.load(args.target, dtype=args.dtype, **load_options(args))
    cfg.check_target(target)  # before the slow data generation
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = self_distill(
        target,
        prompts,
        data,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.gen_batch,
        capture_layers=cfg.feature_layers(target),  # the training pass comes free with the answers
        log=log,
    )
    train(target, cfg, rows, log=log)
    print(f"drafter written to {args.out} (use: hf2q-py generate --method dflash --drafter {args.out})")
    return 0


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of train-dflash's flags (not yet validated)."""
    from hf2q_py.tools.dflash_train import TrainConfig

    return TrainConfig(
        out=args.out,
        layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=_layer_ids(args.target_layers),
        mask_token_id=args.mask_token_id,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        steps=args.steps,
        anchors=args.anchors,
        lr=args.lr,
        holdout=args.holdout,
        eval_every=args.eval_every,
        ce_positions=None if args.ce_positions == -1 else args.ce_positions,
        hidden_weight=args.hidden_weight,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        max_minutes=args.max_minutes,
        overwrite=args.overwrite,
        draft_vocab=args.draft_vocab,
        warm_start=args.warm_start,
        gen_batch=args.gen_batch,
    )


def _layer_ids(text: str | None) -> list[int] | None:
    """``--target-layers`` (comma-separated integers) as a list; None when not given."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Hf2qError(f"--target-layers must be comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    import hf2q_py
    from hf2q_py.tools.bench import markdown_table, run_bench, save_chart, timestamp
    from hf2q_py.generation import make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype
    from hf2q_py.tools.workloads import default_workloads

    methods = [m for m in parse_command_methods(args.methods, args) if m.method != "baseline"]
    if not methods:
        raise Hf2qError("--methods names no method to compare with the baseline")
    common = {"temperature": args.temp, "seed": args.seed} if args.temp != 0 else {}
    for m in methods:  # every option is checked before the model loads
        make_config(max_tokens=args.max_tokens, **common, **m.options)
    check_sources(methods, args.offline)
    only = [x for x in (args.only or "").split(",") if x]
    workloads = [w for w in default_workloads() if not only or any(x in w.name for x in only)]
    if not workloads:
        raise Hf2qError(f"no workload matches --only {args.only!r}")
    for path, what in (
        (args.markdown, "--markdown file"),
        (args.chart, "--chart file"),
        (args.results, "--results file"),
    ):
        if path:
            check_writable(path, what)
    parse_dtype(args.dtype)
    kv_options(args)
    check_source(args.model, offline=args.offline)
    target = load_target(args)
    load_drafts(methods, args.dtype, **load_options(args))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = run_bench(
        target, workloads, methods, max_tokens=args.max_tokens, repeats=args.repeats, common=common, log=log
    )
    table = markdown_table(rows)
    header = (
        f"hf2q-py bench, {timestamp()}: model {target.source}, dtype {args.dtype}, "
        f"max_tokens {args.max_tokens}, repeats {args.repeats}, temperature {args.temp}, "
        f"OpenBLAS {hf2q_py.openblas_status().state}{ranks_note(target)}{kv_note(target)}\n"
    )
    print(header)
    print(table)
    if args.markdown:
        write_text(args.markdown, header + "\n" + table + "\n", "--markdown file")
    if args.results:
        write_bench_results(args, target, rows)
    if args.chart and not save_chart(rows, args.chart):
        print(
            "hf2q-py: matplotlib is not installed; no chart written (pip install 'hf2q-py[chart]')",
            file=sys.stderr,
        )
    return 0


def write_bench_results(args: argparse.Namespace, target, rows) -> None:
    import shlex
    from dataclasses import asdict

    import hf2q_py
    from hf2q_py.tools import results
    from hf2q_py.tools.bench import bench_tables

    settings = dict(
        model=str(target.source),
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        temperature=args.temp,
        openblas=hf2q_py.openblas_status().state,
        **sharding_fields(target),
        **kv_fields(target),
    )
    notes = (
        f"Model {Path(str(target.source)).name}, dtype {args.dtype}, at most {args.max_tokens} new tokens, "
        f"median of {args.repeats} alternating run(s), temperature {args.temp}; decode tok/s."
    )
    rec = results.record(
        "hf2q-py " + shlex.join(args.argv),
        bench_tables(rows),
        notes=notes,
        data={"settings": settings, "rows": [asdict(r) for r in rows]},
    )
    results.write(args.results, rec)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    import hf2q_py
    from hf2q_py.generation import encode_prompt, make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype

    spec = parse_command_methods(args.method, args)[0]  # every option is checked before the model loads
    config = make_config(
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        chat_template=not args.no_chat_template,
        **constraint_options(args),
        **spec.options,
        **sampling_options(args),
    )
    parse_dtype(args.dtype)
    kv_options(args)
    check_source(args.model, offline=args.offline)
    check_sources([spec], args.offline)
    target = load_target(args)
    load_drafts([spec], args.dtype, **load_options(args))
    config.spec.draft = spec.options.get("draft")
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
                    **sharding_fields(target),
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


def read_ab_references(args: argparse.Namespace) -> list | None:
    """The ``--reference`` file's cases (None without one); its cases carry
    their own prompts, lengths and chat-template choice."""
    if args.reference is None:
        return None
    from hf2q_py.tools.ab_reference import read_references

    given = [
        flag
        for flag, value in (
            ("--prompt", args.prompt),
            ("--prompt-file", args.prompt_file),
            ("--prompts", args.prompts),
            ("--max-tokens", args.max_tokens),
            ("--no-chat-template", args.no_chat_template),
        )
        if value
    ]
    if given:
        raise Hf2qError(f"--reference cases set their own prompts and lengths; drop {', '.join(given)}")
    return read_references(args.reference)


MLX_LM_DRAFT = "mlx-lm-draft"
#: Seconds a rank other than 0 waits before exiting on an error rank 0 also meets.
FOLLOWER_ERROR_GRACE = 2.0


def parse_ab_methods(args: argparse.Namespace) -> tuple[list, list[str]]:
    """``--methods`` for ab: method specs, ``mlx-lm-draft[:draft=PATH,k=N]``
    (mlx-lm's speculative decoding, checked as the draft method) and the
    engines (``mlx-lm``, ``llama.cpp``); the option flags fill in what a spec
    leaves out, and K is 4 unless given. Returns (method specs, engine names);
    without ``--methods``: ngram, or nothing with ``--reference``/``--record``."""
    from hf2q_py.method_spec import fill_options, parse_method, split_methods
    from hf2q_py.methods import METHODS
    from hf2q_py.tools.engines import ENGINES

    text = args.methods
    if text is None:
        text = "" if args.reference or args.record else "ngram"
        if not text:
            return fill_options([], flag_options(args)), []
    parts = split_methods(text)
    if not parts:
        raise Hf2qError("--methods is empty")
    specs, engines = [], []
    for text in parts:
        name, colon, rest = (x.strip() for x in text.partition(":"))
        if name in ENGINES:
            if colon:
                raise Hf2qError(f"the engine {name} takes no options, got {text!r}")
            engines.append(name)
            continue
        if name not in (*METHODS, MLX_LM_DRAFT):
            choices = ", ".join([*METHODS, MLX_LM_DRAFT, *ENGINES])
            raise Hf2qError(f"unknown method {name!r} for ab; choose from {choices}")
        spec = parse_method("draft" + colon + rest if name == MLX_LM_DRAFT else text)
        if name == MLX_LM_DRAFT and set(spec.options) - {"method", "draft", "k"}:
            raise Hf2qError(f"{MLX_LM_DRAFT} takes draft and k only, got {text!r}")
        spec.label = text
        specs.append(spec)
    methods = [s for s in fill_options(specs, flag_options(args), {"k": 4}) if s.method != "baseline"]
    if not methods and not engines and not (args.reference or args.record):
        raise Hf2qError("--methods names no method to compare with the baseline")
    return methods, engines


def check_ab_kv(args: argparse.Namespace, methods: list, engines: list[str]) -> None:
    """With --kv-bits, ab compares hf2q-py's methods with plain decoding at the
    same KV storage; other engines and recorded outputs decode at full precision."""
    if args.kv_bits is None:
        return
    others = [*engines, *(m.label for m in methods if m.label.startswith(MLX_LM_DRAFT))]
    others += ["--reference"] if args.reference else []
    if others:
        raise Hf2qError(
            f"--kv-bits compares hf2q-py's methods with plain decoding on the same quantized KV cache; "
            f"{', '.join(others)} decode with full-precision KV: drop {'them' if len(others) > 1 else 'it'}"
        )


def check_ab_outputs(args: argparse.Namespace) -> None:
    """Output files writable, and distinct from the reference read, before the run."""
    both = args.record is not None and args.reference is not None
    if both and os.path.realpath(args.record) == os.path.realpath(args.reference):
        raise Hf2qError("--record would overwrite the --reference file")
    for path, what in ((args.markdown, "--markdown file"), (args.record, "--record file")):
        if path:
            check_writable(path, what)
    bound = args.reference_bound
    if bound is not None and not 0.0 <= bound < float("inf"):
        raise Hf2qError(f"--reference-bound must be a finite number >= 0, got {bound}")


def ab_cases(args: argparse.Namespace, target, prompts: list[str], references: list | None) -> list:
    """The cases to check: the reference file's, else the prompts'."""
    from hf2q_py.generation import encode_prompt
    from hf2q_py.tools.ab import Case, reference_case

    if references is not None:
        return [reference_case(target, r) for r in references]
    chat = not args.no_chat_template
    n = args.max_tokens or 128
    return [Case(p, encode_prompt(target, p, chat), n, chat) for p in prompts]


def cmd_ab(args: argparse.Namespace) -> int:
    from hf2q_py.tools.ab import record_lines, run_ab
    from hf2q_py.tools.ab_reference import write_references
    from hf2q_py.generation import make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype
    from hf2q_py.tools.engines import check_engine

    methods, engines = parse_ab_methods(args)
    check_ab_kv(args, methods, engines)
    for m in methods:  # every option is checked before the model loads
        make_config(max_tokens=args.max_tokens or 128, **m.options)
    references = read_ab_references(args)
    prompts = read_ab_prompts(args) if references is None else []
    check_ab_outputs(args)
    parse_dtype(args.dtype)
    kv_options(args)
    check_source(args.model, offline=args.offline)
    check_sources(methods, args.offline)
    for name in engines:
        check_engine(name, args.model)
    target = load_target(args)
    load_drafts(methods, args.dtype, **load_options(args))
    from hf2q_py.proposers.draft_model import check_compatible

    for m in methods:
        if m.label.startswith(MLX_LM_DRAFT):  # mlx-lm has no check of its own
            check_compatible(target, m.options["draft"])
            m.options = {"draft": m.options["draft"], "k": m.options["k"]}
    cases = ab_cases(args, target, prompts, references)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = run_ab(
        target,
        cases,
        [(m.label, m.options) for m in methods],
        engines=engines,
        reference_bound=args.reference_bound,
        log=log,
    )
    if args.record:
        write_references(args.record, record_lines(target, cases, report.traces))
        log(f"recorded {len(cases)} case(s) to {args.record}")
    if not report.results:
        return 0  # recording only
    print_ab_report(args, report)
    return 1 if report.count("MISMATCH") else 0


def print_ab_report(args: argparse.Namespace, report) -> None:
    """The A/B report: its table and summary (and the quantized KV's effects), as text or JSON."""
    from hf2q_py.tools.ab import kv_summary, kv_table, summary, table

    text, line = table(report.results), summary(report)
    if report.kv_effects:
        text += "\n\n" + kv_table(report.kv_effects)
        line += "\n" + kv_summary(report.kv_effects)
    if args.json:
        noise = report.noise.__dict__ if report.noise is not None else None
        counts = {v: report.count(v) for v in ("identical", "near-tie", "MISMATCH")}
        results = [r.to_dict() for r in report.results]
        effects = [e.to_dict() for e in report.kv_effects]
        print(json.dumps({"noise": noise, "counts": counts, "results": results, "kv_effects": effects}))
    else:
        print(text)
        print()
        print(line)
    if args.markdown:
        write_text(args.markdown, text + "\n\n" + line + "\n", "--markdown file")


def serve_method(args: argparse.Namespace):
    """The server's default method spec, and the model files it serves: the
    spec's ``draft``/``drafter``, else ``--draft-model``/``--drafter`` (which
    serve requests choosing those methods even when the default is another)."""
    from hf2q_py.method_spec import fill_options, parse_methods
    from hf2q_py.methods import method_named

    specs = parse_methods(args.method)
    if len(specs) != 1:
        raise Hf2qError(f"--method takes one method spec, got {len(specs)}")
    flags = flag_options(args)
    files = {key: flags.pop(key) for key in ("draft", "drafter") if flags.get(key) is not None}
    spec = fill_options(specs, flags)[0] if flags else specs[0]
    for key, value in files.items():
        if key in method_named(spec.method).options:
            spec.options.setdefault(key, value)
    served = {key: spec.options.get(key, files.get(key)) for key in ("draft", "drafter")}
    return spec, {key: value for key, value in served.items() if value is not None}


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None and args.api_key_file is not None:
        raise Hf2qError("give --api-key or --api-key-file, not both")
    key = args.api_key if args.api_key_file is None else read_text(args.api_key_file, "API key file").strip()
    if key is not None and (not key or not key.isprintable() or not key.isascii()):
        raise Hf2qError("the API key must be printable ASCII text, not empty")
    return key


def disk_cache_dir(args: argparse.Namespace):
    """The prompt cache's folder on disk, made and checked writable; None when
    it is off (``--no-disk-cache``, ``--no-prompt-cache``, or under
    ``mlx.launch``, whose ranks must agree on every lookup)."""
    from hf2q_py.disk_cache import default_directory, prepare_directory
    from hf2q_py.distributed import launched_group

    if args.no_prompt_cache or args.no_disk_cache or launched_group() is not None:
        return None
    return prepare_directory(args.prompt_cache_dir or default_directory(), "--prompt-cache-dir")


def cmd_serve(args: argparse.Namespace) -> int:
    from hf2q_py.distributed import launched_group
    from hf2q_py.generation import make_config
    from hf2q_py.loaders import check_source
    from hf2q_py.loaders.convert import parse_dtype
    from hf2q_py.method_spec import MethodSpec
    from hf2q_py.scheduler import SchedulerConfig
    from hf2q_py.server.main import bind, follow
    from hf2q_py.validate import check_float

    spec, files = serve_method(args)  # every option is checked before the model loads
    make_config(max_tokens=args.max_tokens, temperature=args.temp, **spec.options)
    check_float("temp", args.temp, 0.0, 2.0)
    key = api_key(args)
    parse_dtype(args.dtype)
    kv_options(args)
    check_source(args.model, offline=args.offline)
    served = MethodSpec("served", {"method": "draft", **files})
    check_sources([spec, served], args.offline)
    if launched_group() is not None and args.shard == "none":
        raise Hf2qError("serve --shard none under mlx.launch would load the model on every rank for one server: "
                        "run serve without mlx.launch, or shard the model")  # fmt: skip
    follower = _rank() > 0  # under mlx.launch, rank 0 serves and the others follow it
    disk_dir = disk_cache_dir(args)  # an unwritable folder: refused before loading
    sock = None if follower else bind(args.host, args.port)  # a port in use: refused before loading
    target = load_target(args)
    load_drafts([served], args.dtype, **load_options(args))
    for option in ("draft", "drafter"):
        if option in spec.options:
            spec.options[option] = served.options[option]
    attach_prompt_cache(args, target, disk_dir)
    if follower:
        return follow(target, served.options, SchedulerConfig(max_batch=args.max_batch))
    return start_server(args, target, spec, served, key, sock)


def attach_prompt_cache(args: argparse.Namespace, target, disk_dir) -> None:
    """serve's prompt cache: in memory, with a disk tier unless the target is sharded or it is off."""
    from hf2q_py.disk_cache import DiskCache
    from hf2q_py.prompt_cache import PromptCache

    if args.no_prompt_cache:
        return
    disk = None
    if disk_dir is not None and target.sharding is None:
        disk = DiskCache(target, disk_dir, args.prompt_cache_disk_bytes)
    target.prompt_cache = PromptCache(args.prompt_cache_entries, args.prompt_cache_bytes, disk)


def start_server(args: argparse.Namespace, target, spec, served, key: str | None, sock) -> int:
    """Rank 0 (or the one process): the HTTP server over the loaded target."""
    from hf2q_py.loaders.hub import display_name
    from hf2q_py.server import ServerConfig, serve

    name = args.served_model_name or display_name(args.model)
    config = ServerConfig(
        model_name=name,
        method=spec.label,
        method_options=spec.options,
        models={k: v for k, v in served.options.items() if k != "method"},
        api_key=key,
        max_tokens=args.max_tokens,
        max_context=args.max_context,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        temperature=args.temp,
        memory=serving_budget(args, target),
    )

    def announce(url: str) -> None:
        print(f"hf2q-py serve: {name} ({spec.label}) at {url}/v1", flush=True)

    return serve(target, config, sock=sock, access_log=args.access_log, announce=announce)


def serving_budget(args, target):
    """The server's memory budget; none for a sharded target, whose ranks
    would otherwise admit requests by budgets of their own shards."""
    from hf2q_py.budget import MemoryBudget

    if target.sharding is not None:
        return None
    return MemoryBudget(args.memory_budget, max_waiting=args.memory_queue, name="--memory-budget")


def kv_note(target) -> str:
    return f", {target.kv.describe()}" if target.kv.quantized else ""


def kv_fields(target) -> dict:
    """``kv_bits``, ``kv_group_size`` and ``quantized_kv_start`` for results files."""
    kv = target.kv
    return {"kv_bits": kv.bits, "kv_group_size": kv.group_size if kv.quantized else None,
            "quantized_kv_start": kv.start if kv.quantized else None}  # fmt: skip


def ranks_note(target) -> str:
    sh = target.sharding
    return f", {sh.size} ranks ({sh.mode} parallel)" if sh is not None else ""


def _rank() -> int:
    """This process's rank under ``mlx.launch`` (0 when it runs alone)."""
    if not any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK")):
        return 0
    from hf2q_py.distributed import launched_group

    group = launched_group()
    return group.rank() if group is not None else 0


def _local(error: Hf2qError) -> bool:
    """Errors one rank can have alone (its files), which every rank reports."""
    from hf2q_py.distributed import RanksDiverged
    from hf2q_py.errors import ModelLoadError

    return isinstance(error, (ModelLoadError, RanksDiverged))


COMMANDS = {
    "generate": cmd_generate,
    "bench": cmd_bench,
    "ab": cmd_ab,
    "train-dflash": cmd_train_dflash,
    "serve": cmd_serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "no_openblas", False) and "mlx.core" not in sys.modules:
        # OpenBLAS is loaded when hf2q_py is imported; restart with mlx.core first.
        os.execv(sys.executable, [sys.executable, "-c", _NO_OPENBLAS_BOOT, *argv])
    rank = _rank()
    if rank:  # under mlx.launch, rank 0 alone prints and writes; the others run the same loop in silence
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        for output in ("results", "markdown", "chart"):
            if getattr(args, output, None) is not None:
                setattr(args, output, None)
    try:
        return COMMANDS[args.command](args)
    except Hf2qError as e:
        if not rank or _local(e):
            where = f" (rank {rank})" if rank else ""
            print(f"hf2q-py{where}: error: {one_line(e, limit=1000)}", file=sys.stderr)
        else:
            # rank 0 meets the same error and prints it; mlx.launch kills every rank
            # once one exits with an error, so give rank 0 the time to say it first
            time.sleep(FOLLOWER_ERROR_GRACE)
        return 2
    except KeyboardInterrupt:
        print("hf2q-py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
