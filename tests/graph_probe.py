"""Runs ``pretrain.train`` in this process (world size 1) with the engine compiled by dynamo's tracing
alone (``backend="eager"``: no inductor build, the same graphs) and records, after each training step,
how many graphs dynamo has traced and where it broke one. Writes ``{"graphs": [n after step 1, ...],
"breaks": {...}}`` as JSON to the path in argv[1]; the rest of argv goes to ``pretrain.train``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch._dynamo.utils import counters

    import pretrain.train as train

    compile_engine = DeepSpeedEngine.compile

    def traced_only(self, *args, **kwargs):
        kwargs["backend"] = "eager"
        return compile_engine(self, *args, **kwargs)

    DeepSpeedEngine.compile = traced_only
    graphs: list[int] = []
    step_fn = train.train_step

    def counted_step(*args, **kwargs):
        result = step_fn(*args, **kwargs)
        graphs.append(counters["stats"]["unique_graphs"])
        return result

    train.train_step = counted_step
    code = train.main(argv)
    out.write_text(json.dumps({"graphs": graphs, "breaks": dict(counters["graph_break"]), "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
