"""Runs ``pretrain.train`` in this process (world size 1) with ``impl.cuda_graphs`` taken as on even
without CUDA: the step compiled with torch.compile's ``reduce-overhead`` mode (inductor records CUDA
graphs only on a GPU; on the CPU it compiles the same kernels) and the step begun anew before each
micro-batch, as on a GPU. Records the compile's keyword arguments and how many times a new graph step
was marked; writes them as JSON to the path in argv[1]; the rest of argv goes to ``pretrain.train``.

It also records what a GPU would re-record its graphs on: the addresses of the compiled module's
static inputs (its parameters and buffers, and every tensor dynamo reached through a module's
attribute, which it marks static as well) at each micro-batch. A CUDA graph reads a static input at
the address it was recorded with; where that address changes, inductor records the graph again, on
every such call, without counting it against its re-record limit or logging a skip
(``torch/_inductor/cudagraph_trees.py``, ``StaticInputIdxMismatch``). ``addresses``: each static
input's number of distinct addresses over the run; ``unresolved``: sources the probe could not read."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch._dynamo.variables.builder import VariableBuilder

    import pretrain.train as train
    from pretrain.runtime import engine as eng

    eng.cuda_graphs_plan = lambda cfg, device_type, compiled: (compiled, "taken as on for tests/cuda_graphs_probe.py")
    compiled_with, marks, modules = [], [0], []
    sources: set[str] = set()  # static tensors dynamo reached by a path of attributes, by that path
    addresses: dict[str, set[int]] = defaultdict(set)
    compile_engine, mark = DeepSpeedEngine.compile, torch.compiler.cudagraph_mark_step_begin
    mark_static = VariableBuilder.mark_static_input

    def recorded_compile(self, *args, **kwargs):
        compiled_with.append(kwargs.get("compile_kwargs", {}))
        modules.append(self.module)
        return compile_engine(self, *args, **kwargs)

    def recorded_mark_static(self, value, guard):
        named = [*modules[-1].parameters(), *modules[-1].buffers()] if modules else []
        if not any(value is t for t in named):  # the module's own tensors are read by name below
            sources.add(self.source.name)
        return mark_static(self, value, guard)

    def counted_mark():  # before each micro-batch's forward, its dropout keys set
        marks[0] += 1
        root = modules[-1]
        for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
            addresses[name].add(tensor.data_ptr())
        for source in sources:
            try:
                value = eval(source, {"L": {"self": root}})  # noqa: S307 - dynamo's own source path
            except Exception:  # a path from another frame, e.g. DeepSpeed's own
                continue
            if isinstance(value, torch.Tensor):
                addresses[source].add(value.data_ptr())

        return mark()

    DeepSpeedEngine.compile = recorded_compile
    VariableBuilder.mark_static_input = recorded_mark_static
    torch.compiler.cudagraph_mark_step_begin = counted_mark
    code = train.main(argv)
    report = {
        "compiled_with": compiled_with,
        "marks": marks[0],
        "exit": code,
        "addresses": {name: len(seen) for name, seen in sorted(addresses.items())},
        "unresolved": sorted(s for s in sources if s not in addresses),
    }
    out.write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(main())
