"""What inductor writes to memory for a BERT model's compiled forward and backward, with keyed dropout's
hash per pair and per element (``impl.dropout_hash``) side by side, on the CPU.

Inductor decides which values to write out while lowering, the same on any device but for two limits
(``realize_opcount_threshold``, ``realize_acc_reads_threshold``), set here to a GPU's: the buffers it
allocates on the CPU are those it would on a GPU. Prints, per mode and graph, the MB of buffers a step
allocates and those of an integer or bool dtype as large as half a dropout site (a hash or a mask).

    .venv/bin/python bench/inductor_buffers.py [--rows 8] [--length 128] [--hidden 256] [--layers 1]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402
from transformers import BertConfig, BertModel  # noqa: E402

from pretrain.model import keyed_dropout  # noqa: E402

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "uint8": 1}
GPU_LIMITS = {"realize_opcount_threshold": 30, "realize_acc_reads_threshold": 8, "fx_graph_cache": False}


def buffers(code: str) -> list[tuple[int, str]]:
    """(elements, dtype) of each buffer a generated CPU module allocates."""
    found = re.findall(r"empty_strided_cpu\(\((.*?)\), \(.*?\), torch\.(\w+)\)", code)
    return [(math.prod(int(v) for v in size.split(",") if v.strip()), dtype) for size, dtype in found]


def compiled_step(args, per_element: bool) -> list[str]:
    """The generated code of one compiled forward and backward of a BERT model with keyed dropout."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.length,
        vocab_size=1000,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = BertModel(config, add_pooling_layer=False).train()
    key = keyed_dropout.install(model, seed=0, per_element=per_element)
    key.set(torch.arange(args.rows), step=3)
    ids = torch.randint(0, 1000, (args.rows, args.length))
    compiled = torch.compile(model)

    def step():
        compiled(input_ids=ids).last_hidden_state.float().pow(2).sum().backward()

    with inductor_config.patch(GPU_LIMITS):
        _, codes = run_and_get_code(step)
    return codes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args(argv)
    half_site = args.rows * args.length * args.hidden // 2
    print(
        f"BERT, {args.layers} layer(s), {args.rows} x {args.length} x {args.hidden}, fp32, a GPU's realisation limits"
    )
    totals = {}
    for mode in ("per_pair", "per_element"):
        codes = compiled_step(args, per_element=mode == "per_element")
        for graph, code in zip(("forward", "backward"), codes):
            found = buffers(code)
            total = sum(n * BYTES.get(d, 4) for n, d in found) / 1e6
            hashes = [f"{n:,} {d}" for n, d in found if d in ("int64", "int32", "bool", "uint8") and n >= half_site]
            totals[mode, graph] = total
            print(f"{mode:>11} {graph:>8}: {total:6.2f} MB allocated; hashes and masks: {', '.join(hashes) or 'none'}")
    for graph in ("forward", "backward"):
        print(f"per_element / per_pair, {graph}: {totals['per_element', graph] / totals['per_pair', graph]:.3f}x")


if __name__ == "__main__":
    main()
