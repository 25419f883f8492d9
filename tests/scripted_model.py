"""A model folder whose greedy answer is a script: a tiny llama whose next
token depends only on the current one (its layers add nothing to the
embedding, its head maps each token to its successor), with a tokenizer of
single characters plus each script piece as one token.

A script is a chain of pieces from a start character: after the prompt's
last token (the chat template's generation prompt ends with "\\n"), the model
writes the pieces in order, then ends (EOS). Every piece must be distinct
(a piece is a token, and a token has one successor). More tokens the model
never writes (a family's markers its template uses: ``<think>``,
``<|start|>``, ...) can be added to the vocabulary. Served with
``hf2q-py serve --model FOLDER`` like any mlx-lm folder.

``write_agent_folder`` builds the same kind of model on the built-in
SmolLM2's real byte-level BPE tokenizer (so an agent's 7,000-15,000-token
prompt keeps its size) with a context of 65,536: the model an agent CLI
completes a session with (``tests/test_agent_clients.py``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import hf2q_py  # noqa: F401  first: OpenBLAS before mlx.core
import mlx.core as mx

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
EOS = "<|im_end|>"

#: A ChatML template that renders tools (Hermes/Qwen style) and tool history.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call tools. For each call write <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: The same without tools: a template with no tool support.
PLAIN_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def vocabulary(scripts: dict[str, list[str]], tokens: tuple[str, ...] = ()) -> list[str]:
    pieces = [p for chain in scripts.values() for p in chain] + list(tokens)
    if len(set(pieces)) != len(pieces) or set(pieces) & set(CHARS + SPECIALS):
        raise ValueError("script pieces and tokens must be distinct, and longer than one character")
    return SPECIALS + CHARS + pieces


def write_scripted_folder(
    folder: Path,
    scripts: dict[str, list[str]],
    template: str = TOOLS_TEMPLATE,
    tokens: tuple[str, ...] = (),
    second: dict[str, str] | None = None,
) -> Path:
    """An mlx-lm folder (config, float32 weights, tokenizer with ``template``)
    whose greedy answer after a prompt ending in ``start`` is ``scripts[start]``;
    ``tokens``: more tokens for the vocabulary, which the model never writes.
    ``second``: a piece's second choice (half its first's logit), what the
    model writes after it when its first choice is masked (by a grammar)."""
    vocab = vocabulary(scripts, tokens)
    index = {t: i for i, t in enumerate(vocab)}
    size = (len(vocab) + 31) // 32 * 32
    nxt = {t: index[EOS] for t in vocab}  # what is not scripted ends the answer
    for start, chain in scripts.items():
        for a, b in zip([start, *chain], [*chain, EOS]):
            nxt[a] = index[b]
    folder.mkdir(parents=True, exist_ok=True)
    seconds = {index[a]: index[b] for a, b in (second or {}).items()}
    _write_model(folder, size, {index[t]: n for t, n in nxt.items()}, index[EOS], second=seconds)
    _write_tokenizer(folder, vocab, template)
    return folder


def write_cycling_folder(folder: Path, context: int = 4096) -> Path:
    """An mlx-lm folder whose greedy answer to any prompt is the printable
    ASCII characters in a cycle, never ending: it runs until ``max_tokens``
    (or the context) ends it, a long request on demand."""
    vocab = SPECIALS + CHARS
    index = {t: i for i, t in enumerate(vocab)}
    printable = CHARS[:-1]
    successor = {index[t]: index[EOS] for t in vocab}
    for a, b in zip(printable, printable[1:] + printable[:1]):
        successor[index[a]] = index[b]
    successor[index["\n"]] = index[printable[0]]  # the generation prompt's end starts the cycle
    folder.mkdir(parents=True, exist_ok=True)
    _write_model(folder, (len(vocab) + 31) // 32 * 32, successor, index[EOS], context)
    _write_tokenizer(folder, vocab, PLAIN_TEMPLATE)
    return folder


def _write_model(
    folder: Path,
    vocab_size: int,
    successor: dict[int, int],
    eos: int,
    context: int = 4096,
    second: dict[int, int] | None = None,
) -> None:
    """One llama layer that adds nothing (zero output projections): the
    residual stream stays the embedding, a one-hot state per scripted token
    (state 0 for every other token); the head maps each state to its token's
    successor (and, at half the logit, its ``second`` choice), state 0 to EOS."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    scripted = sorted(t for t, n in successor.items() if n != eos or t in (second or {}))
    hidden = (len(scripted) + 1 + 31) // 32 * 32
    cfg = dict(
        model_type="llama", hidden_size=hidden, num_hidden_layers=1, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=context,
    )  # fmt: skip
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        weights[name] = mx.zeros(w.shape) if w.ndim == 2 else mx.ones(w.shape)
    tokens, states = mx.array(scripted), mx.arange(1, len(scripted) + 1)
    embed = mx.zeros((vocab_size, hidden))
    embed[:, 0] = 1.0
    embed[tokens, 0] = 0.0
    embed[tokens, states] = 1.0
    head = mx.zeros((vocab_size, hidden))
    head[eos, 0] = 10.0
    head[mx.array([successor[t] for t in scripted]), states] = 10.0
    for t, alternative in (second or {}).items():
        head[alternative, scripted.index(t) + 1] = 5.0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()}
    )
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))


def char_tokenizer(vocab: list[str], template: str) -> Any:
    """A Hugging Face tokenizer of single characters (``vocabulary``'s order)
    plus the longer pieces as added tokens, with ``template``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = {t: i for i, t in enumerate(vocab[: len(SPECIALS) + len(CHARS)])}
    tok = Tokenizer(models.WordLevel(vocab=base, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False) for t in vocab[len(base) :]])
    assert tok.get_vocab_size() == len(vocab) and all(tok.token_to_id(t) == i for i, t in enumerate(vocab))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>", bos_token=None)
    hf.chat_template = template
    return hf


def _write_tokenizer(folder: Path, vocab: list[str], template: str) -> None:
    char_tokenizer(vocab, template).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


# -- the agent model: SmolLM2's BPE tokenizer, a long context ----------------------------------
#: Qwen2.5's way with tools (tools in the system turn, calls in <tool_call> tags, results in
#: <tool_response> tags of a user turn), every system message kept where it stands. The
#: generation prompt ends in one of three tokens of SmolLM2's vocabulary, which the model
#: answers in three ways: "\n\n" once the last message (system ones aside) is a tool result
#: (the answer), "\n" when tools are given and the last user message names TRIGGER (the
#: tool call), "\n\n\n" otherwise (a plain answer).
AGENT_TEMPLATE = """{%- set ns = namespace(last="", asks=false) %}
{%- for message in messages %}{% if message.role != "system" %}{% set ns.last = message.role %}{% endif %}
{%- if message.role == "user" %}{% set ns.asks = "TRIGGER" in message.content %}{% endif %}{% endfor %}
{%- if tools %}<|im_start|>system
{% if messages[0].role == "system" %}{{ messages[0].content }}{{ "\\n\\n" }}{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}{{ "\\n" }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if loop.first and tools and message.role == "system" %}
{%- elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{{ "\\n" }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{{ "\\n" }}
{%- endfor %}<|im_end|>{{ "\\n" }}
{%- elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>{{ "\\n" }}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>{{ "\\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{{- "\\n\\n" if ns.last == "tool" else ("\\n" if tools and ns.asks else "\\n\\n\\n") }}
{%- endif %}"""

#: The three prompt endings and what the agent model writes after each.
CALL_START, ANSWER_START, PLAIN_START = "\n", "\n\n", "\n\n\n"


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_json() -> str:
    """The built-in SmolLM2's tokenizer (from its GGUF, through hf2q-py's loader) as
    tokenizers' JSON: read once per process (about a second)."""
    from hf2q_py.loaders.builtin import builtin_model_path
    from hf2q_py.loaders.gguf_file import read_header
    from hf2q_py.loaders.gguf_tokenizer import tokenizer_from_gguf

    wrapper = tokenizer_from_gguf(read_header(builtin_model_path()).metadata)
    return wrapper._tokenizer.backend_tokenizer.to_str()


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as AGENT_TEMPLATE's system turn asks for it (Hermes/Qwen2.5)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def write_agent_folder(
    folder: Path,
    call: list[str],
    answer: list[str],
    plain: list[str],
    trigger: str,
    context: int = 65536,
) -> Path:
    """An mlx-lm folder on SmolLM2's tokenizer whose greedy answers follow
    AGENT_TEMPLATE's three endings: ``call`` (pieces, such as one
    ``tool_call_text``) when the last user message names ``trigger`` and tools
    are given, ``answer`` after a tool result, ``plain`` otherwise. Each piece
    becomes one added token."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(smollm2_tokenizer_json())
    pieces = [*call, *answer, *plain]
    if len(set(pieces)) != len(pieces) or any(tok.token_to_id(p) is not None for p in pieces):
        raise ValueError("script pieces must be distinct and new to the vocabulary")
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    ids = {p: base + i for i, p in enumerate(pieces)}
    eos = tok.token_to_id(EOS)
    successor: dict[int, int] = {}
    for start, chain in ((CALL_START, call), (ANSWER_START, answer), (PLAIN_START, plain)):
        (first,) = tok.encode(start, add_special_tokens=False).ids  # one token each in SmolLM2
        order = [first, *(ids[p] for p in chain)]
        successor.update(zip(order, [*order[1:], eos]))
    folder.mkdir(parents=True, exist_ok=True)
    _write_model(folder, (tok.get_vocab_size() + 31) // 32 * 32, successor, eos, context)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token="<|im_start|>")
    hf.chat_template = AGENT_TEMPLATE.replace("TRIGGER", trigger)
    hf.save_pretrained(folder)
    return folder
