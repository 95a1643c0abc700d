"""The training loader reading shards from a bucket against the same shards in a local folder (issue 35).

One run, one machine: real text sharded at sequence 128, copied into a real S3 server (SeaweedFS,
started here on 127.0.0.1 as the tests start it), then the rank-0 loader of a 1-rank run
(``TrainStream``, 2 workers, the trainer's own) timed over the same micro-batches from

    local          the folder
    s3             the bucket, directly
    s3 +20 ms      through a TCP proxy that holds every request 20 ms (a far region)
    s3 +100 ms     ... 100 ms (another continent)

each with read-ahead on (the default: a worker's next micro-batches' blocks fetched by 8 threads)
and off (one GET at a time, when needed). Prints tokens/s and the ratio to local.

    python bench/remote_loader.py [--micro-batches 120] [--micro-batch 32]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
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
    subprocess.run([*run, "shard", "--input", f"{work}/corpus/*.txt", "--tokenizer", str(bert_uncased_dir()),
                    "--out", str(out), "--seq-len", "128", "--shard-size", "1024"], check=True, cwd=REPO,
                   capture_output=True)
    subprocess.run([*run, "finalize", str(out)], check=True, cwd=REPO, capture_output=True)
    return out


def time_loader(location: str, micro_batches: int, micro_batch: int, read_ahead: bool) -> float:
    """tokens/s of the rank-0 loader of a 1-rank run over ``micro_batches`` micro-batches, in a fresh
    process (its own workers, module settings and connections)."""
    code = f"""
import time, sys
sys.path.insert(0, {str(REPO)!r})
import pretrain.data.shard_reader as sr, pretrain.data.stream as st
if not {read_ahead}:
    sr.READ_AHEAD_THREADS, st.READ_AHEAD = 1, 0
from data_prep.shard_format import load_manifest
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
    p.add_argument("--micro-batches", type=int, default=120)
    p.add_argument("--micro-batch", type=int, default=32)
    args = p.parse_args()
    import s3_server

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shards = make_shards(work)
        weed_args, endpoint, _ = s3_server._start(work / "s3")
        proc = s3_server._launch(weed_args, work / "s3")
        try:
            server = s3_server.S3Server(endpoint, "", work, proc)
            for _ in range(180):
                try:
                    bucket = server.bucket("bench")
                    break
                except Exception:      # noqa: BLE001 -- not up yet
                    time.sleep(0.5)
            client = server.client()
            for path in sorted(q for q in shards.rglob("*") if q.is_file()):
                client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
            os.environ.update(server.aws())
            port = int(endpoint.rsplit(":", 1)[1])
            rows = []
            for label, delay in (("local", None), ("s3", 0.0), ("s3 +20 ms", 0.020), ("s3 +100 ms", 0.100)):
                location = str(shards) if delay is None else f"s3://{bucket}/wiki"
                if delay:
                    proxy = DelayProxy(port, delay)
                    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
                elif delay is not None:
                    os.environ["AWS_ENDPOINT_URL"] = endpoint
                for read_ahead in ((True,) if delay is None else (True, False)):
                    rate = time_loader(location, args.micro_batches, args.micro_batch, read_ahead)
                    rows.append((label, read_ahead, rate))
                    print(f"{label:12} read-ahead {'on ' if read_ahead else 'off'} {rate:12,.0f} tokens/s", flush=True)
        finally:
            s3_server._stop(proc)
    local = rows[0][2]
    print(f"\n{'source':12} {'read-ahead':>10} {'tokens/s':>12} {'x local':>8}   "
          f"({args.micro_batches} micro-batches of {args.micro_batch} x 128, 2 workers)")
    for label, read_ahead, rate in rows:
        print(f"{label:12} {'on' if read_ahead else 'off':>10} {rate:12,.0f} {rate / local:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
