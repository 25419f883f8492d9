"""A model folder whose greedy answer is a script: a tiny llama whose next
token depends only on the current one (its layers add nothing to the
embedding, its head maps each token to its successor), with a tokenizer of
single characters plus each script piece as one token.

A script is a chain of pieces from a start character: after the prompt's
last token (the chat template's generation prompt ends with "\\n"), the model
writes the pieces in order, then ends (EOS). Every piece must be distinct
(a piece is a token, and a token has one successor). Served with
``hf2q-py serve --model FOLDER`` like any mlx-lm folder.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def vocabulary(scripts: dict[str, list[str]]) -> list[str]:
    pieces = [p for chain in scripts.values() for p in chain]
    if len(set(pieces)) != len(pieces) or set(pieces) & set(CHARS + SPECIALS):
        raise ValueError("script pieces must be distinct, and longer than one character")
    return SPECIALS + CHARS + pieces


def write_scripted_folder(
    folder: Path, scripts: dict[str, list[str]], template: str = TOOLS_TEMPLATE
) -> Path:
    """An mlx-lm folder (config, float32 weights, tokenizer with ``template``)
    whose greedy answer after a prompt ending in ``start`` is ``scripts[start]``."""
    vocab = vocabulary(scripts)
    index = {t: i for i, t in enumerate(vocab)}
    size = (len(vocab) + 31) // 32 * 32
    nxt = {t: index[EOS] for t in vocab}  # what is not scripted ends the answer
    for start, chain in scripts.items():
        for a, b in zip([start, *chain], [*chain, EOS]):
            nxt[a] = index[b]
    folder.mkdir(parents=True, exist_ok=True)
    _write_model(folder, size, {index[t]: n for t, n in nxt.items()})
    _write_tokenizer(folder, vocab, template)
    return folder


def _write_model(folder: Path, size: int, successor: dict[int, int]) -> None:
    """One llama layer that adds nothing (zero output projections): the
    residual stream stays the one-hot embedding, and the head reads it."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = dict(
        model_type="llama", hidden_size=size, num_hidden_layers=1, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=size, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    weights = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        weights[name] = mx.zeros(w.shape) if w.ndim == 2 else mx.ones(w.shape)
    weights["model.embed_tokens.weight"] = mx.eye(size)
    head = mx.zeros((size, size))
    rows, cols = mx.array(list(successor.values())), mx.array(list(successor.keys()))
    head[rows, cols] = 10.0
    weights["lm_head.weight"] = head
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()}
    )
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2}))


def _write_tokenizer(folder: Path, vocab: list[str], template: str) -> None:
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
    hf.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
