"""End-of-generation tokens of a GGUF vocabulary, as llama.cpp infers them.

llama.cpp (``llama_vocab::impl::load``, 0.3.36's vendored copy) ends a
generation at: the EOS, EOT and EOM ids the file declares; the fill-in-the-
middle pad, repo and separator tokens (declared or recognized by text); and
every token whose text is in its list of turn and text ends, whatever type the
file gives it. Two corrections follow: where ``<|return|>`` and ``<|call|>``
(o200k harmony) or ``<|calls|>`` and ``<|flush|>`` (solar-open) exist, ``<|end|>``
does not end; where ``<|tool_response>`` (Gemma 4) or ``<|plamo:eos|>`` exist,
``</s>`` is a normal token.
"""

from __future__ import annotations

from typing import Any

#: Token texts llama.cpp always treats as an end of generation.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
#: Fill-in-the-middle tokens that end a generation when the file does not name them.
FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_DECLARED = ("eos", "eot", "eom")


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """Sorted ids of every token that ends a generation for this vocabulary."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    ids = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    for key in _DECLARED:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= i < len(tokens):
            ids.add(int(i))
    for key, texts in FIM_TEXTS.items():
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            i = next((j for j, t in enumerate(tokens) if t in texts), None)
        if i is not None and 0 <= i < len(tokens):
            ids.add(int(i))
    texts = {tokens[i]: i for i in ids}
    if ("<|return|>" in texts and "<|call|>" in texts) or ("<|calls|>" in texts and "<|flush|>" in texts):
        ids.discard(texts.get("<|end|>", -1))
    if "<|tool_response>" in texts or "<|plamo:eos|>" in texts:
        ids.discard(texts.get("</s>", -1))
    return sorted(ids)
