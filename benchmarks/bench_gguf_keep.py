"""A GGUF file loaded as it is stored (``dtype="keep"``: quantized tensors stay
MLX-quantized) against the same file in float32: memory of the weights, MLX's
peak memory while loading, load time, the largest logit difference on a prompt, and whether greedy decoding
gives the same tokens.

On this CPU MLX's quantized matmul is slow (only float32 matmuls use BLAS),
so decode speed is not compared here; on Apple GPUs the quantized path is
the fast one.

    python benchmarks/bench_gguf_keep.py model.gguf [--tokens 24] [--results benchmarks/results/gguf_keep_qwen05.json]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import hf2q_py  # first: loads OpenBLAS before mlx.core

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from hf2q_py.errors import Hf2qError, run_script
from hf2q_py.loaders.gguf_file import read_header
from hf2q_py.tools import results
from hf2q_py.tools.files import check_writable

PROMPT = "Write a Python function that reverses a string."


def weight_bytes(target) -> int:
    return sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))


def quantized_layers(target) -> dict[str, object]:
    return {n: m for n, m in target.model.named_modules() if hasattr(m, "scales") and hasattr(m, "bits")}


def against_numpy(path: Path, target) -> dict[str, float]:
    """Per GGUF type, the largest difference between a kept layer's weights
    (MLX's dequantization of what the loader packed) and the ``gguf``
    package's numpy dequantizer on the file's blocks, relative to the tensor's
    largest value (tensors whose rows the loader reorders are skipped)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from hf2q_py.loaders.gguf_arch import arch_spec, mlx_name

    spec = arch_spec(read_header(path))
    layers = quantized_layers(target)
    worst: dict[str, float] = {}
    for t in GGUFReader(str(path)).tensors:
        name = mlx_name(t.name, spec)
        layer = layers.get(name.rsplit(".", 1)[0]) if name and name.endswith(".weight") else None
        if layer is None or (spec.permuted_qk and name.split(".")[-2] in ("q_proj", "k_proj")):
            continue
        want = dequantize(t.data, t.tensor_type).reshape(layer.weight.shape[:-1] + (-1,))
        got = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                                     bits=layer.bits).astype(mx.float32))  # fmt: skip
        err = float(np.abs(got - want).max() / np.abs(want).max())
        worst[t.tensor_type.name] = max(worst.get(t.tensor_type.name, 0.0), err)
    return worst


def float16_scale_layout(target) -> tuple[int, float]:
    """Bytes of the same weights with float16 scales and biases (the layout off
    the CPU, see ``scale_dtype``), and the largest weight change that rounding
    makes, relative to its layer's largest weight."""
    total, worst = weight_bytes(target), 0.0
    for _, m in quantized_layers(target).items():
        total -= (m.scales.nbytes + m.biases.nbytes) // 2
        exact = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
        s16, b16 = (a.astype(mx.float16).astype(mx.float32) for a in (m.scales, m.biases))
        rounded = mx.dequantize(m.weight, s16, b16, group_size=m.group_size, bits=m.bits)
        worst = max(worst, float(mx.abs(rounded - exact).max() / mx.abs(exact).max()))
    return total, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    path = Path(args.gguf)
    if not path.is_file():
        raise Hf2qError(f"{path}: no such file")
    if args.results:
        check_writable(args.results, "--results file")
    types = Counter(t.type_name for t in read_header(path).tensors.values())
    loaded, seconds, peak = {}, {}, {}
    for dtype in ("keep", "float32"):
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        loaded[dtype] = hf2q_py.load(path, dtype=dtype)
        seconds[dtype] = time.perf_counter() - t0
        peak[dtype] = mx.get_peak_memory()
    keep, flt = loaded["keep"], loaded["float32"]
    ids = hf2q_py.encode_prompt(flt, PROMPT)
    a, b = keep.model(mx.array([ids]))[0], flt.model(mx.array([ids]))[0]
    diff, scale = float(mx.abs(a - b).max()), float(mx.abs(b).max())
    same_argmax = bool(mx.all(a.argmax(-1) == b.argmax(-1)).item())
    gpu_bytes, f16_error = float16_scale_layout(keep)
    numpy_gap = against_numpy(path, keep)
    quantized = sum(m.weight.size * 32 // m.bits for m in quantized_layers(keep).values())
    total = sum(v.size for n, v in tree_flatten(flt.model.parameters()))
    tokens = {
        d: hf2q_py.generate(t, ids, max_tokens=args.tokens, method="baseline").tokens
        for d, t in loaded.items()
    }
    rows = [
        [d, f"{weight_bytes(t) / 2**20:.0f}", f"{peak[d] / 2**20:.0f}", f"{seconds[d]:.1f}"]
        for d, t in loaded.items()
    ]
    rows.append(["keep / float32", f"{weight_bytes(keep) / weight_bytes(flt):.2f}x", "", ""])
    file_mib = path.stat().st_size / 2**20
    rows.append(["keep / file", f"{weight_bytes(keep) / path.stat().st_size:.2f}x", "", ""])
    rows.append(["keep, float16 scales (GPU layout, computed)", f"{gpu_bytes / 2**20:.0f}", "", ""])
    rows.append(["  / file", f"{gpu_bytes / path.stat().st_size:.2f}x", "", ""])
    notes = (
        f"{path.name} ({file_mib:.0f} MiB; tensor types {dict(types)}). Prompt of {len(ids)} tokens: "
        f"largest logit difference keep vs float32 {diff:.3g} (logits up to {scale:.3g}), same argmax at "
        f"every position: {same_argmax}; greedy {args.tokens} tokens identical: "
        f"{tokens['keep'] == tokens['float32']}. Weights in quantized layers: {quantized / total:.1%} "
        f"of all. float16 scales move a weight by at most {f16_error:.2g} of its layer's largest. "
        "Kept weights against the gguf package's numpy dequantizer, largest difference relative to "
        f"the tensor's largest value: {', '.join(f'{k} {v:.2g}' for k, v in sorted(numpy_gap.items()))}."
    )
    rec = results.record(
        shlex.join(["python", *sys.argv]),
        [results.table(["dtype", "weights MiB", "peak MiB while loading", "load s"], rows, "lrrr")],
        notes=notes,
        data={"types": dict(types), "bytes": {d: weight_bytes(t) for d, t in loaded.items()},
              "load_seconds": seconds, "peak_bytes": peak, "max_logit_diff": diff, "logit_scale": scale,
              "same_argmax": same_argmax, "same_tokens": tokens["keep"] == tokens["float32"],
              "file_bytes": path.stat().st_size, "float16_scale_bytes": gpu_bytes,
              "float16_scale_error": f16_error, "quantized_weight_share": quantized / total,
              "against_numpy": numpy_gap},
    )  # fmt: skip
    results.publish(rec, args.results)


if __name__ == "__main__":
    run_script(main)
