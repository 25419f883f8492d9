"""The method table and the method-spec syntax ``name:key=value,flag`` that
every command accepts (``generate --method``, ``ab --methods``, ``bench --methods``)."""

import dataclasses
import json
import shlex
import subprocess
import sys

import pytest
from models import random_prompt, tiny_target

import hf2q_py
import hf2q_py.request as request
from hf2q_py.config import SpecConfig
from hf2q_py.draft_length import AdaptiveK, FixedK
from hf2q_py.errors import Hf2qError
from hf2q_py.method_spec import parse_method, parse_methods
from hf2q_py.methods import METHODS, OPTIONS, Method, build_proposer
from hf2q_py.proposers.base import Draft, Proposer
from hf2q_py.proposers.ngram import DEFAULT_MAX_N, NgramProposer
from hf2q_py.tools.cli import build_parser, main

# -- the table ------------------------------------------------------------------------


def test_every_option_is_a_spec_config_field_with_the_tables_default():
    fields = {f.name: f.default for f in dataclasses.fields(SpecConfig)}
    assert set(fields) == {"method", *OPTIONS}
    for name, option in OPTIONS.items():
        assert fields[name] == option.default, name


def test_every_method_row_names_known_options_and_a_builder_that_imports():
    for method in METHODS.values():
        assert set(method.options) <= set(OPTIONS), method.name
        assert set(method.required) <= set(method.options), method.name
        if method.build is not None:
            assert callable(method.builder()), method.name
    used = {name for m in METHODS.values() for name in m.options}
    assert used == set(OPTIONS)  # no option that no method takes


@pytest.mark.parametrize(
    "spec, k",
    [
        (SpecConfig(method="ngram"), 32),
        (SpecConfig(method="ngram", ngram_proposer="lookup"), 16),
        (SpecConfig(method="draft", draft="d.gguf"), 16),
        (SpecConfig(method="layerskip"), 8),
        (SpecConfig(method="ngram", k=5), 5),
    ],
)
def test_default_draft_lengths_come_from_the_method_row(spec, k):
    assert spec.draft_length == k


def test_the_ngram_max_default_lives_in_one_place(capsys):
    assert SpecConfig().ngram_max == OPTIONS["ngram_max"].default == DEFAULT_MAX_N
    assert NgramProposer().index.max_n == DEFAULT_MAX_N
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert f"(default {DEFAULT_MAX_N})" in " ".join(capsys.readouterr().out.split())


def test_an_option_of_another_method_is_refused_in_python_too():
    with pytest.raises(
        Hf2qError, match="'skip_layers' belongs to layerskip, not to ngram; ngram takes k, adaptive"
    ):
        SpecConfig(method="ngram", skip_layers=[1]).validate()
    with pytest.raises(Hf2qError, match="baseline takes no options"):
        SpecConfig(method="baseline", k=4).validate()


class EchoProposer(Proposer):
    """Drafts the last token again: enough to show a new method end to end."""

    name = "echo"

    def propose(self, tokens, k):
        return Draft([tokens[-1]] * k)


def build_echo(target, spec):
    return EchoProposer()


def test_a_new_proposer_is_one_module_and_one_row(monkeypatch):
    row = Method(
        "echo", "repeats the last token", ("k", "adaptive"), default_k=3, build=f"{__name__}:build_echo"
    )
    monkeypatch.setitem(METHODS, "echo", row)
    target = tiny_target("llama")
    prompt = random_prompt(10)
    want = hf2q_py.generate(target, prompt, max_tokens=12, method="baseline").tokens
    got = hf2q_py.generate(target, prompt, max_tokens=12, method="echo", adaptive=False)
    assert got.tokens == want and got.stats.drafted > 0
    assert parse_method("echo:k=2,fixed").options == {"method": "echo", "k": 2, "adaptive": False}
    with pytest.raises(Hf2qError, match="echo takes k, adaptive, fixed"):
        parse_method("echo:memory=no")


# -- the syntax -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, options",
    [
        ("ngram", {}),
        ("ngram:k=8,fixed", {"k": 8, "adaptive": False}),
        ("ngram:adaptive=false", {"adaptive": False}),
        ("ngram:adaptive=no,memory=0", {"adaptive": False, "memory": False}),
        ("ngram:adaptive=off,memory=yes", {"adaptive": False, "memory": True}),
        ("ngram:adaptive=1,memory=true", {"adaptive": True, "memory": True}),
        ("ngram:adaptive,memory", {"adaptive": True, "memory": True}),  # a boolean's bare name is true
        ("ngram:ngram-proposer=lookup,ngram_max=7", {"ngram_proposer": "lookup", "ngram_max": 7}),  # - or _
        ("ngram: suffix_min_prob = 0.25 ", {"suffix_min_prob": 0.25}),
        ("layerskip:skip_layers=[3,5,7],k=4", {"skip_layers": [3, 5, 7], "k": 4}),
        ("layerskip:skip_layers=[ 3, 5 ]", {"skip_layers": [3, 5]}),
        ("layerskip:skip_layers=middle:6", {"skip_layers": "middle:6"}),
        ("draft:draft=small.gguf,draft_p_min=0.2", {"draft": "small.gguf", "draft_p_min": 0.2}),
        ("dflash:drafter=my-drafter,k=7", {"drafter": "my-drafter", "k": 7}),
    ],
)
def test_values_are_parsed_by_the_options_kind(text, options):
    assert parse_method(text).options == {"method": text.split(":")[0], **options}


def test_several_methods_are_separated_by_semicolons_or_by_commas_without_options():
    assert [m.label for m in parse_methods("ngram;ngram:k=4,fixed; layerskip")] == [
        "ngram",
        "ngram:k=4,fixed",
        "layerskip",
    ]
    assert [m.method for m in parse_methods("ngram,layerskip")] == ["ngram", "layerskip"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("magic", ["unknown method 'magic'", "baseline, ngram, draft, layerskip, dflash"]),
        ("ngram:bogus=1", ["unknown method option 'bogus'", "ngram takes k, adaptive, ngram_proposer"]),
        ("ngram:temperature=0.5", ["unknown method option 'temperature'", "--temp"]),
        ("ngram:skip_layers=[1]", ["'skip_layers' belongs to layerskip", "ngram takes k"]),
        (
            "layerskip:memory=no",
            ["'memory' belongs to ngram", "layerskip takes k, adaptive, skip_layers, fixed"],
        ),
        ("baseline:k=2", ["'k' belongs to", "baseline takes no options"]),
        ("ngram:k=x", ["bad value for k", "an integer"]),
        ("ngram:k=2.5", ["bad value for k"]),
        ("ngram:k=0", ["k (draft length)", "ngram:k=0"]),
        ("ngram:suffix_min_prob=high", ["bad value for suffix_min_prob", "a number"]),
        ("ngram:suffix_min_prob=2", ["suffix-min-prob"]),
        ("ngram:adaptive=maybe", ["bad value for adaptive", "yes/no"]),
        ("ngram:memory=", ["bad value for memory"]),
        ("ngram:ngram_proposer=tree", ["bad value for ngram_proposer", "suffix, lookup"]),
        ("ngram:k", ["k needs a value"]),
        ("ngram:fixed=1", ["fixed is a flag"]),
        ("ngram:k=2,k=3", ["k is given twice"]),
        ("layerskip:skip_layers=[1,x]", ["bad value for skip_layers", "[3,5,7]"]),
        ("layerskip:skip_layers=[1,2", ["unbalanced '['"]),
        ("layerskip:skip_layers=early:x", ["skip recipe"]),
        ("draft:draft=", ["bad value for draft"]),
    ],
)
def test_bad_specs_are_one_line_errors_naming_the_key(text, words):
    with pytest.raises(Hf2qError) as e:
        parse_method(text)
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


def test_adaptive_false_runs_a_fixed_k():
    """Regression: ``ngram:adaptive=false`` once ran adaptive K."""
    target = tiny_target("llama")
    for text, policy in (("ngram:adaptive=false", FixedK), ("ngram:fixed", FixedK), ("ngram", AdaptiveK)):
        spec = SpecConfig(**parse_method(text).options)
        assert type(build_proposer(target, spec)[1]) is policy, text


def test_the_cli_parser_does_not_import_mlx():
    """``--no-openblas`` restarts the process unless mlx.core is already imported."""
    code = (
        "import sys; from hf2q_py.tools.cli import build_parser; build_parser(); "
        "print('mlx.core' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# -- every command takes the same strings --------------------------------------------


@pytest.fixture
def specs_seen(monkeypatch):
    """Run the CLI on a tiny model and record each SpecConfig that reaches generation."""
    seen = []
    real = request.build_proposer

    def spy(target, spec, **kw):
        seen.append(dataclasses.replace(spec))
        return real(target, spec, **kw)

    monkeypatch.setattr(request, "build_proposer", spy)
    monkeypatch.setattr(hf2q_py, "load", lambda *a, **k: tiny_target("llama", tokenizer=True))
    return seen


def cli(capsys, command: str | list[str]):
    """Run ``hf2q-py COMMAND`` (a command line, split as a shell would, or argv);
    returns (status, stdout, stderr lines)."""
    try:
        rc = main(shlex.split(command) if isinstance(command, str) else command)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def test_generate_takes_a_method_spec(capsys, specs_seen):
    rc, out, err = cli(
        capsys,
        "generate --prompt abcabc --max-tokens 4 --json --method ngram:k=8,fixed,ngram_proposer=lookup",
    )
    assert rc == 0, err
    spec = specs_seen[-1]
    assert (spec.method, spec.k, spec.adaptive, spec.ngram_proposer) == ("ngram", 8, False, "lookup")
    assert json.loads(out)["stats"]["method"] == "ngram"


def test_generate_flags_fill_in_what_the_spec_leaves_out(capsys, specs_seen):
    rc, _, err = cli(
        capsys,
        "generate --prompt abc --max-tokens 2 --method ngram:k=8 --k 3 --fixed-k --ngram-max 7 --no-memory",
    )
    assert rc == 0, err
    spec = specs_seen[-1]
    assert (spec.k, spec.adaptive, spec.ngram_max, spec.memory) == (8, False, 7, False)  # the spec wins
    rc, _, err = cli(capsys, "generate --prompt abc --max-tokens 2 --method layerskip --skip-layers 1")
    assert rc == 0, err
    assert specs_seen[-1].skip_layers == "1"


def test_ab_and_bench_take_the_same_strings(capsys, specs_seen):
    rc, out, err = cli(
        capsys,
        "ab --prompt abcabc --max-tokens 3 --json --methods 'ngram:k=2,fixed;layerskip:skip_layers=[1]'",
    )
    assert rc == 0, err
    assert [(s.method, s.k, s.adaptive) for s in specs_seen] == [("ngram", 2, False), ("layerskip", 4, True)]
    assert specs_seen[1].skip_layers == [1]
    assert [r["method"] for r in json.loads(out)["results"]] == [
        "ngram:k=2,fixed",
        "layerskip:skip_layers=[1]",
    ]
    specs_seen.clear()
    rc, out, err = cli(
        capsys,
        "bench --only explain --max-tokens 2 --methods 'ngram:k=2,fixed;ngram:ngram_proposer=lookup,adaptive=no'",
    )
    assert rc == 0, err
    methods = [(s.method, s.k, s.adaptive, s.ngram_proposer) for s in specs_seen if s.method != "baseline"]
    assert methods == [("ngram", 2, False, "suffix"), ("ngram", None, False, "lookup")]
    assert "ngram:ngram_proposer=lookup,adaptive=no" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "--prompt", "hi", "--method", "ngram:adaptive=maybe"], ["bad value for adaptive"]),
        (
            ["generate", "--prompt", "hi", "--method", "ngram", "--skip-layers", "auto"],
            ["--skip-layers is an option of layerskip"],
        ),
        (["generate", "--prompt", "hi", "--method", "draft"], ["needs a draft model", "--draft-model"]),
        (["generate", "--prompt", "hi", "--method", "ngram:k=300"], ["k (draft length)"]),
        (
            ["generate", "--prompt", "hi", "--method", "ngram", "--ngram-proposer", "tree"],
            ["--ngram-proposer"],
        ),
        (["ab", "--methods", "ngram:bogus=1"], ["unknown method option 'bogus'"]),
        (["ab", "--methods", "mlx-lm-draft:fixed"], ["mlx-lm-draft takes draft and k only"]),
        (["ab", "--methods", "ngram;magic"], ["unknown method 'magic'", "mlx-lm-draft"]),
        (["bench", "--methods", "ngram:skip_layers=[1]"], ["'skip_layers' belongs to layerskip"]),
        (["bench", "--methods", "layerskip:skip_layers=[1,x]"], ["bad value for skip_layers"]),
    ],
)
def test_every_command_refuses_a_bad_spec_in_one_line(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(
        hf2q_py, "load", lambda *a, **k: pytest.fail("loaded a model before checking options")
    )
    rc, _, err = cli(capsys, argv)
    assert rc == 2 and len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]
