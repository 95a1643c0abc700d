"""Host metrics (CPU, memory, disk, network; GPU with pynvml) for an MLflow run, under ``system/``
as MLflow's own monitor names them. MLflow's monitor thread stops for good at the first failed
request and sends directly, so only its samplers are used here: the samples go through the
tracker's buffer, which survives a server outage.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from pretrain import metric_names as names

log = logging.getLogger(__name__)


def start_system_metrics(
    run_id: str, tracking_uri: str, enqueue: Callable[[list], None], stop: threading.Event, first_step: int
) -> None:
    """Sample in a daemon thread until ``stop`` is set; each aggregate goes to ``enqueue`` as
    ``("metric", name, value, ts_ms, step)`` items, steps counting on from ``first_step``."""
    try:
        import psutil  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, tracking_uri=tracking_uri)
    except Exception as exc:  # noqa: BLE001 - optional; never worth failing a run over
        log.info("MLflow: system metrics off (%s)", exc)
        return
    threading.Thread(
        target=_sample, args=(monitor, enqueue, stop, first_step), name="mlflow-system-metrics", daemon=True
    ).start()


def _sample(monitor, enqueue: Callable[[list], None], stop: threading.Event, step: int) -> None:
    interval = float(monitor.sampling_interval)
    per_log = max(1, int(monitor.samples_before_logging))
    taken = 0
    try:
        while not stop.wait(interval):
            monitor.collect_metrics()
            taken += 1
            if taken % per_log:
                continue
            values = monitor.aggregate_metrics()
            for m in monitor.monitors:
                m.clear_metrics()
            now = int(time.time() * 1000)
            enqueue([("metric", names.system(k), float(v), now, step) for k, v in values.items()])
            step += 1
    except Exception as exc:  # noqa: BLE001
        log.info("MLflow: system metrics stopped (%s)", exc)
