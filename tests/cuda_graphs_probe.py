"""Runs ``pretrain.train`` in this process (world size 1) with ``impl.cuda_graphs`` taken as on even
without CUDA: the step compiled with torch.compile's ``reduce-overhead`` mode (inductor records CUDA
graphs only on a GPU; on the CPU it compiles the same kernels) and the step begun anew before each
micro-batch, as on a GPU. Records the compile's keyword arguments and how many times a new graph step
was marked; writes them as JSON to the path in argv[1]; the rest of argv goes to ``pretrain.train``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    import pretrain.train as train
    from pretrain.runtime import engine as eng

    eng.cuda_graphs_plan = lambda cfg, device_type, compiled: (compiled, "taken as on for tests/cuda_graphs_probe.py")
    compiled_with, marks = [], [0]
    compile_engine, mark = DeepSpeedEngine.compile, torch.compiler.cudagraph_mark_step_begin

    def recorded_compile(self, *args, **kwargs):
        compiled_with.append(kwargs.get("compile_kwargs", {}))
        return compile_engine(self, *args, **kwargs)

    def counted_mark():
        marks[0] += 1
        return mark()

    DeepSpeedEngine.compile = recorded_compile
    torch.compiler.cudagraph_mark_step_begin = counted_mark
    code = train.main(argv)
    out.write_text(json.dumps({"compiled_with": compiled_with, "marks": marks[0], "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
