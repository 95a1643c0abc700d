"""CUDA graphs recorded again or not used are said on the run's log (``impl.cuda_graphs``): inductor
says so only on its debug log, and a graph recorded again because a static input moved counts as no
skip (the H200's 0.158x of 2026-11-28 left nothing in the log). Inductor records graphs only on a
GPU; here its own loggers and its own message functions carry what it would say there."""

from __future__ import annotations

import logging

import torch
from torch._inductor import cudagraph_trees, cudagraph_utils

from pretrain.runtime import graph_records


def moved_input_reason() -> str:
    """Inductor's reason for a static input whose address moved (``log_data_ptr_mismatch``)."""
    placeholder = cudagraph_utils.PlaceholderInfo("primals_7", None, [], None)
    moved = torch.zeros(4)
    return cudagraph_utils.log_data_ptr_mismatch(
        [placeholder],
        [moved],
        [moved.data_ptr() + 64],
        [0],
        cudagraph_utils.CheckInvariantStatus.StaticInputIdxMismatch,
    )


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_graphs_recorded_again_and_not_used_are_warnings_with_their_reason_and_count(caplog, monkeypatch):
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    torch_handlers = Kept()  # what torch's own handlers, which print every level, would be given
    for name in ("torch", "torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.cudagraph_utils"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [*logging.getLogger(name).handlers, torch_handlers])
    graph_records.watch()
    graph_records.watch()  # a second engine in the process: still one line each
    reason = moved_input_reason()

    def recording(function: str, mode: str, graph: int) -> None:  # as CUDAGraphTreeManager.record_function says it
        cudagraph_trees.log.debug(
            "[%s] Recording function=%s, mode=%s, cuda_graph_id=%d, inputs: %s", "0/0", function, mode, graph, "3"
        )

    with caplog.at_level(logging.INFO, logger="pretrain"):
        recording("forward", "FORWARD", 0)  # each function's first recording says nothing
        recording("backward", "BACKWARD", 1)
        for graph in range(graph_records.EVERY):  # the forward's static input moved before each replay
            cudagraph_trees.log.debug(
                "[%s] Re-recording function=%s, mode=%s, reason=%s", "0/0", "forward", "FORWARD", reason
            )
            recording("forward", "FORWARD", 2 + graph)
        recording("backward", "BACKWARD", 200)  # recorded again on a path of its own: no reason given
        cudagraph_utils.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
    said = [r.getMessage() for r in caplog.records if r.name == "pretrain"]
    moved = "forward forward: static input data pointer changed (primals_7 moved)"
    new_path = "backward backward: no recorded graph of it could run here (a new path in inductor's tree)"
    assert said == [
        f"cuda graphs: recorded again (1 so far): {moved}",
        f"cuda graphs: recorded again (100 so far): {moved}",
        f"cuda graphs: recorded again (1 so far): {new_path}",
        "cuda graphs: not used (1 so far): mutated inputs (2 instances)",
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "pretrain")
    # inductor's own debug lines stay away from torch's handler, which would print them
    assert not [line for line in torch_handlers.lines if "Recording function" in line], torch_handlers.lines
    assert graph_records.seen(["x " + line for line in said]) == {
        ("recorded again", moved): 100,
        ("recorded again", new_path): 1,
        ("not used", "mutated inputs (2 instances)"): 1,
    }
