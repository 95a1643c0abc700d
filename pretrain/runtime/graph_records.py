"""What inductor's CUDA graphs do that a replay should not need, said on the run's log
(``impl.cuda_graphs``): a function's graph recorded again, and a compiled function run without its
graph.

Inductor says both only on its ``cudagraphs`` debug log, which is off unless ``TORCH_LOGS`` names it,
and a graph recorded again because a static input moved counts against no limit and logs no skip
(``torch/_inductor/cudagraph_trees.py``, ``StaticInputIdxMismatch``): the H200 lease of 2026-11-28
ran graphs at 0.158x of the run without them with nothing in its log (docs/gpu-step.md). Here the
first time of each reason is a warning, then every ``EVERY``-th, with the count so far; the smoke
test's ``graphs`` check reads these lines (``bench/gpu_smoke_checks.py``)."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

log = logging.getLogger("pretrain")

# inductor's artifact loggers for its "cudagraphs" log: the trees' recordings, the skips
INDUCTOR_LOGS = ("torch._inductor.cudagraph_trees.__cudagraphs", "torch._inductor.cudagraph_utils.__cudagraphs")
EVERY = 100
LINE = re.compile(r"cuda graphs: (?P<kind>recorded again|not used) \((?P<count>\d+) so far\): (?P<reason>.*)")
_AGAIN = re.compile(r"Re-recording function=(?P<function>\S+), mode=(?P<mode>\w+), reason=(?P<status>[^\n]*)")
_RECORDING = re.compile(r"\] Recording function=(?P<function>\S+), mode=(?P<mode>\w+),")
_SKIP = "skipping cudagraphs due to "


class GraphRecords(logging.Handler):
    """Counts inductor's recordings of a function's graph past its first, and its skips, by reason;
    ``counts`` by (kind, reason). A recording past the first is said with the reason inductor gave
    just before it (``Re-recording ... reason=``), or as a new path in its tree where it gave none."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[tuple[str, str]] = Counter()
        self._recorded: Counter[str] = Counter()  # by "mode function"
        self._why: dict[str, str] = {}  # the reason inductor gave for the next recording of each

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if found := _AGAIN.search(text):
            # the inputs that moved, by their names in the graph (their addresses differ every time)
            moved = sorted(set(re.findall(r"input name: (\S+?)\.? data pointer changed", text)))
            status = found["status"].strip().rstrip(".")
            self._why[_function(found)] = status + (f" ({', '.join(moved)} moved)" if moved else "")
            return
        if found := _RECORDING.search(text):
            function = _function(found)
            self._recorded[function] += 1
            why = self._why.pop(function, "no recorded graph of it could run here (a new path in inductor's tree)")
            if self._recorded[function] > 1:
                self._say(("recorded again", f"{function}: {why}"))
        elif _SKIP in text:
            self._say(("not used", text.split(_SKIP, 1)[1].splitlines()[0].strip()))

    def _say(self, key: tuple[str, str]) -> None:
        self.counts[key] += 1
        count = self.counts[key]
        if count == 1 or count % EVERY == 0:
            log.warning("cuda graphs: %s (%d so far): %s", key[0], count, key[1])


def _function(found: re.Match) -> str:
    return f"{found['mode'].lower()} {found['function']}"


def watch() -> GraphRecords:
    """Inductor's cudagraphs log, read by a ``GraphRecords``. Its debug lines (every recording, with
    its inputs) stop there unless ``TORCH_LOGS`` asks for them: at DEBUG they would reach torch's own
    handler, which prints every level."""
    loggers = [logging.getLogger(name) for name in INDUCTOR_LOGS]
    held = [h for h in loggers[0].handlers if isinstance(h, GraphRecords)]
    records = held[0] if held else GraphRecords()  # one a process, however many engines it compiles
    for inductor_log in loggers:
        inductor_log.setLevel(logging.DEBUG)
        inductor_log.propagate = "cudagraphs" in os.environ.get("TORCH_LOGS", "")
        if records not in inductor_log.handlers:
            inductor_log.addHandler(records)
    return records


def seen(lines) -> dict[tuple[str, str], int]:
    """The counts a run's log says, by (kind, reason): the last said of each."""
    counts = {}
    for line in lines:
        if found := LINE.search(line):
            counts[(found["kind"], found["reason"].strip())] = int(found["count"])
    return counts
