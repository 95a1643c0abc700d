"""The training loader reading shards from a bucket against the same shards in a local folder (issue 35).

One run, one machine: real text sharded at sequence 128, copied into a real S3 server (SeaweedFS,
started here on 127.0.0.1 as the tests start it), then the rank-0 loader of a 1-rank run
(``TrainStream``, 2 workers, the trainer's own) timed over the same micro-batches from

    local          the folder
    s3             the bucket, directly
    s3 +20 ms      through a TCP proxy that holds every request 20 ms (a far region)
    s3 +100 ms     ... 100 ms (another continent)

each with read-ahead on (the default: a worker's next micro-batches' blocks fetched by 8 threads)
and off (one GET at a time, when needed), with the node cache off (every block a ranged GET); then
at 100 ms with the node cache (``data.cache_dir``) cold (blocks by range while the shards download
in the background) and warm (every shard already on local disk). Prints tokens/s and the ratio to
local (the median of 3 runs, each in a fresh process).

Then the trainer itself: a 1-rank mini run (``configs/mini.yaml``, fp32) from the local folder and
from the bucket at +100 ms with the cache off, printing ``perf/data_wait_s`` against
``perf/step_time_s`` (the issue's goal: under 5% of the step).

    python bench/remote_loader.py [--micro-batches 600] [--micro-batch 32] [--repeats 3] [--mini-steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pretrain import metric_names as names  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))


class DelayProxy:
    """127.0.0.1:port -> upstream, every client-to-server chunk (an HTTP request) held ``delay_s``."""

    def __init__(self, upstream_port: int, delay_s: float):
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def pump(reader, writer, delay):
            try:
                while data := await reader.read(1 << 16):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(client_r, client_w):
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            await asyncio.gather(pump(client_r, up_w, self.delay_s), pump(up_r, client_w, 0))

        async def start():
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await server.serve_forever()

        self.loop.run_until_complete(start())


def make_shards(work: Path) -> Path:
    from data_prep.sample_corpus import bert_uncased_dir, write_sample_corpus

    write_sample_corpus(work / "corpus", "txt", num_files=4)
    out = work / "shards"
    run = [sys.executable, "-m", "data_prep"]
    subprocess.run(
        [
            *run,
            "shard",
            "--input",
            f"{work}/corpus/*.txt",
            "--tokenizer",
            str(bert_uncased_dir()),
            "--out",
            str(out),
            "--seq-len",
            "128",
            "--shard-size",
            "1024",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    subprocess.run([*run, "finalize", str(out)], check=True, cwd=REPO, capture_output=True)
    return out


def time_loader(location: str, micro_batches: int, micro_batch: int, read_ahead: bool, cache_dir: str = "") -> float:
    """tokens/s of the rank-0 loader of a 1-rank run over ``micro_batches`` micro-batches, in a fresh
    process (its own workers, module settings and connections); the node cache at ``cache_dir``."""
    code = f"""
import time, sys
sys.path.insert(0, {str(REPO)!r})
import pretrain.data.shard_reader as sr, pretrain.data.stream as st
from pretrain.data import shard_cache
shard_cache.configure({cache_dir!r}, 50.0 if {bool(cache_dir)} else 0.0)
if not {read_ahead}:
    sr.READ_AHEAD_THREADS, st.READ_AHEAD = 1, 0
from data_prep.common.manifest import load_manifest
m = load_manifest({location!r})
s = st.TrainStream({location!r}, m, "train", 0, 1, {micro_batch}, {micro_batch}, 1234, num_workers=2)
it = iter(s)
next(it)
t0 = time.perf_counter()
for _ in range({micro_batches}):
    next(it)
print({micro_batches} * {micro_batch} * m.seq_len / (time.perf_counter() - t0))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3, help="runs per row, each in a fresh process; the median")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--mini-steps", type=int, default=20)
    args = p.parse_args()
    if args.mini_steps < 10:
        p.error("--mini-steps: at least 10 (two windows of 5 logged steps: the first, start-up, is left out)")
    import s3_server

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shards = make_shards(work)
        with s3_server.serving(work / "s3") as server:
            bucket, endpoint = server.bucket("bench"), server.endpoint
            client = server.client()
            for path in sorted(q for q in shards.rglob("*") if q.is_file()):
                client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
            os.environ.update(server.aws())
            port = int(endpoint.rsplit(":", 1)[1])
            remote = f"s3://{bucket}/wiki"
            rows = loader_rows(str(shards), remote, endpoint, args, work / "cache")
            mini = [("local", mini_run(str(shards), work / "mini-local", args.mini_steps))]
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{DelayProxy(port, 0.100).port}"
            mini.append(("s3 +100 ms, no cache", mini_run(remote, work / "mini-s3", args.mini_steps)))
    local = rows[0][2]
    print(
        f"\n{'source':24} {'read-ahead':>10} {'tokens/s':>12} {'x local':>8}   "
        f"({args.micro_batches} micro-batches of {args.micro_batch} x 128, 2 workers)"
    )
    for label, read_ahead, rate in rows:
        print(f"{label:24} {'on' if read_ahead else 'off':>10} {rate:12,.0f} {rate / local:8.3f}")
    print(f"\n{'mini run, 1 rank, fp32':24} {'step s':>8} {'data wait s':>12} {'wait/step':>10}")
    for label, (step_s, wait_s) in mini:
        print(f"{label:24} {step_s:8.3f} {wait_s:12.4f} {wait_s / step_s:10.2%}")
    return 0


def loader_rows(local: str, remote: str, endpoint: str, args, cache: Path) -> list[tuple[str, bool, float]]:
    port, rows = int(endpoint.rsplit(":", 1)[1]), []

    def row(label: str, location: str, read_ahead: bool, cache_dir=lambda repeat: "") -> None:
        rates = sorted(
            time_loader(location, args.micro_batches, args.micro_batch, read_ahead, cache_dir(r))
            for r in range(args.repeats)
        )
        rate = rates[len(rates) // 2]  # the median: runs of a few seconds on shared cores vary 15%
        rows.append((label, read_ahead, rate))
        print(f"{label:24} read-ahead {'on ' if read_ahead else 'off'} {rate:12,.0f} tokens/s", flush=True)

    row("local", local, True)
    for label, delay in (("s3", 0.0), ("s3 +20 ms", 0.020), ("s3 +100 ms", 0.100)):
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{DelayProxy(port, delay).port}" if delay else endpoint
        for read_ahead in (True, False):
            row(label, remote, read_ahead)
    row("s3 +100 ms, cache cold", remote, True, lambda repeat: str(cache / f"cold{repeat}"))
    fill_cache(remote, cache / "warm")
    row("s3 +100 ms, cache warm", remote, True, lambda repeat: str(cache / "warm"))
    return rows


def fill_cache(location: str, cache: Path) -> None:
    """Every shard downloaded into the node cache, by the cache itself (what a long run's first epoch
    leaves there)."""
    from data_prep.common.manifest import load_manifest
    from data_prep.common.storage import open_store
    from pretrain.data.shard_cache import ShardCache

    store, node_cache = open_store(location), ShardCache(cache, 50 * 2**30)
    for entry in load_manifest(location).shards:
        node_cache.fetch(store, entry)
        assert node_cache.lookup(entry) is not None, entry.name


def mini_run(location: str, out: Path, steps: int) -> tuple[float, float]:
    """The mean ``perf/step_time_s`` and ``perf/data_wait_s`` of a 1-rank mini run, its first logged
    window (start-up, the first fetches) left out."""
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        "configs/mini.yaml",
        f"data.dir={location}",
        f"train.out_dir={out}",
        f"train.max_steps={steps}",
        "train.log_every=5",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "tracking.report=false",
        "data.cache_limit_gb=0",
        "impl.zero_stage=0",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if names.PERF_DATA_WAIT_S in r][1:]
    return (
        sum(r[names.PERF_STEP_TIME_S] for r in rows) / len(rows),
        sum(r[names.PERF_DATA_WAIT_S] for r in rows) / len(rows),
    )


if __name__ == "__main__":
    raise SystemExit(main())
