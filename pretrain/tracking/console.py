"""A console a person can read: our own lines on rank 0; third-party chatter in a file.

Left alone, a run's console mixes our lines with DeepSpeed's INFO lines and op builds, torch's
``FutureWarning``s (``all_gather_into_tensor`` on every save) and transformers' load reports. Those
go to ``<out_dir>/third_party-rank<N>.log`` instead; their errors still reach the console, and so do
warnings from anything that is not known chatter. Also here: the time left in the progress line, the
progress of work counted in bytes, and the summary at the end of a run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from data_prep.progress import MIB
from pretrain import metric_names as names

OURS = ("pretrain", "data_prep")
# Known chatter: to the console, errors only.
CHATTY = ("DeepSpeed", "transformers", "torch", "accelerate", "mlflow", "alembic", "py.warnings")
QUIET_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
_LOG_FILE: Path | None = None


class _ConsoleFilter(logging.Filter):
    """Ours from INFO; known chatter from ERROR; anything else from WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if any(name == o or name.startswith(o + ".") for o in OURS):
            return True
        if any(name == c or name.startswith(c + ".") for c in CHATTY):
            return record.levelno >= logging.ERROR
        return record.levelno >= logging.WARNING


def quiet_third_party(out_dir: str, rank: int) -> Path:
    """Route third-party logging and deprecation warnings of this process to a file in the run folder."""
    global _LOG_FILE
    path = _LOG_FILE = Path(out_dir) / f"third_party-rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    for handler in root.handlers:
        handler.addFilter(_ConsoleFilter())
    root.addHandler(to_file)
    root.setLevel(logging.INFO)  # third-party INFO reaches the file, not the console
    logging.getLogger("pretrain").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    _route_library_loggers()
    _warnings_to(logging.getLogger("py.warnings"))
    silence_transformers_load_report()
    # datasets' bars (reading a downstream task's CSV) drew on the training console: off, whether
    # datasets is imported already or later
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    # MLflow, imported later, would give its logger a console handler of its own.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    return path


def _route_library_loggers() -> None:
    """DeepSpeed, transformers and MLflow each give their logger a console handler of its own (at
    import): through the root's handlers instead, so to the file, and to the console as filtered."""
    for name in ("DeepSpeed", "transformers", "mlflow", "datasets"):
        lib = logging.getLogger(name)
        lib.handlers, lib.propagate = [], True
        lib.setLevel(logging.INFO)


def _warnings_to(logger: logging.Logger) -> None:
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, QUIET_CATEGORIES):
            logger.info("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def silence_transformers_load_report() -> None:
    """transformers prints its load report (missing MLM head weights etc.) through its own logger;
    ``pretrain.model`` says in one line which weights start fresh instead."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.disable_progress_bar()  # "Loading weights" bars on every rank
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


@contextlib.contextmanager
def chatter_to_file():
    """Prints and progress bars of a library call (DeepSpeed's checkpoint conversion on export) go to
    the third-party log, not the console."""
    if _LOG_FILE is None:
        yield
        return
    # File descriptors too: DeepSpeed's op checks run the compiler in subprocesses, whose errors
    # ("cannot find -laio") go straight to fd 2.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(_LOG_FILE, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield
        finally:
            f.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            # A library imported in here (DeepSpeed, by the first init_distributed) gave its logger a
            # handler on this file object, closed next: every later warning would be a "Logging error".
            _route_library_loggers()


def metrics_line(metrics: dict) -> str:
    """``key=value`` pairs for a log line; train/ and perf/ go without saying, eval/ and the rest keep
    their group."""

    def short(key: str) -> str:
        group, _, name = key.partition("/")
        return name if group in ("train", "perf") and name else key

    def fmt(v) -> str:
        if isinstance(v, int):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"

    return " ".join(f"{short(k)}={fmt(v)}" for k, v in metrics.items())


def time_left(steps_left: int, seconds_per_step: float) -> str:
    seconds = max(0, round(steps_left * seconds_per_step))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def duration(seconds: float) -> str:
    """``1m05s``, ``2h03m``: a wait's length or what is left of it, in the progress lines' format."""
    return time_left(1, seconds)


class ByteMeter:
    """Work counted in bytes (a checkpoint downloaded, read or written) says how far along it is: at
    most every ``every_s``, before the next piece of work, ``say`` gets a line with the MiB done of the
    total, the share, the rate and the time left."""

    def __init__(self, label: str, total: int, say: Callable[[str], None], every_s: float = 30.0):
        self.label, self.total, self.say, self.every_s = label, total, say, every_s
        self.done = 0
        self.started = self.said = time.monotonic()

    def starting(self, size: int) -> None:
        """A piece of ``size`` bytes begins: the line of what is done, if ``every_s`` has passed since
        the last one; then the piece counts as done (the next call comes after it)."""
        now = time.monotonic()
        if self.done and now - self.said >= self.every_s:
            self.said = now
            rate = self.done / max(now - self.started, 1e-9)
            left = f"about {duration((self.total - self.done) / rate)} left" if self.done >= MIB else "no rate yet"
            self.say(
                f"{self.label}: {self.done / MIB:,.1f} of {self.total / MIB:,.1f} MiB "
                f"({self.done / max(self.total, 1):.0%}, {rate / MIB:,.1f} MiB/s), {left}"
            )
        self.done += size


def summary(state, cfg, run_s: float, job_s: float, last_metrics: dict, tracker) -> str:
    """The end-of-run summary: what was done (in the run's time, every job of it; this job's beside it
    when there were others), where it is."""
    out = Path(cfg.train.out_dir)
    losses = ", ".join(f"{k} {v:.4f}" for k, v in last_metrics.items() if k in (names.TRAIN_LOSS, names.EVAL_LOSS))
    took = time_left(1, run_s) + (f" (this job: {time_left(1, job_s)})" if run_s - job_s > 0.5 else "")
    lines = [
        f"done: {state.step} steps, {state.tokens_seen:,} tokens in {took}" + (f"; {losses}" if losses else ""),
        f"  checkpoints: {out / 'checkpoints'}",
    ]
    if (out / "hf_final").is_dir():
        lines.append(f"  export: {out / 'hf_final'}")
    if state.skipped_windows:
        lines.append(f"  loss spikes recovered: {len(state.skipped_windows)}")
    run_id = getattr(tracker, "run_id", None)
    if run_id:
        lines.append(f"  tracking run: {run_id} ({cfg.tracking.backend})")
    return "\n".join(lines)
