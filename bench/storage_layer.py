"""Which S3 client `data_prep/common/storage/` should use: boto3 directly, or fsspec's s3fs (issue 34).

Times, in one run against one bucket, what the storage layer does most: a multipart upload of a
shard-sized file, and random ranged reads of block-sized spans (the trainer's read pattern: one GET
per block at the manifest's offsets). Each client runs in its own process; s3fs comes from a
separate venv, because its aiobotocore pins botocore to versions that would move boto3 in ours.

    python -m venv /tmp/s3fs-venv && /tmp/s3fs-venv/bin/pip install s3fs
    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
      python bench/storage_layer.py s3://bucket/bench [--mb 96] [--reads 300] [--block-kb 64] \\
                                    [--s3fs-python /tmp/s3fs-venv/bin/python]

Prints seconds and MB/s per client and the ratios s3fs / boto3.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix.strip("/")


def run_client(client: str, url: str, mb: int, reads: int, block: int, seed: int = 0) -> dict:
    """Upload ``mb`` MiB, then ``reads`` random ranged reads of ``block`` bytes; seconds of each."""
    bucket, prefix = _split(url)
    key = f"{prefix}/{client}-{os.getpid()}.bin".lstrip("/")
    rng = random.Random(seed)
    size = mb << 20
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "upload.bin"
        local.write_bytes(os.urandom(size))
        if client == "boto3":
            import boto3
            from boto3.s3.transfer import TransferConfig

            s3 = boto3.session.Session().client("s3")
            config = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20)
            t0 = time.perf_counter()
            s3.upload_file(str(local), bucket, key, Config=config)
            upload = time.perf_counter() - t0

            def ranged(start: int) -> bytes:
                return s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + block - 1}")["Body"].read()
        else:
            import s3fs

            fs = s3fs.S3FileSystem(endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
            t0 = time.perf_counter()
            fs.put_file(str(local), f"{bucket}/{key}")
            upload = time.perf_counter() - t0

            def ranged(start: int) -> bytes:
                return fs.cat_file(f"{bucket}/{key}", start=start, end=start + block)

    starts = [rng.randrange(0, size - block) for _ in range(reads)]
    assert len(ranged(starts[0])) == block
    t0 = time.perf_counter()
    got = sum(len(ranged(s)) for s in starts)
    read = time.perf_counter() - t0
    assert got == reads * block
    return {
        "client": client,
        "upload_s": upload,
        "upload_mb_s": mb / upload,
        "reads": reads,
        "read_s": read,
        "ms_per_read": 1e3 * read / reads,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="s3://bucket/prefix to write the test objects under")
    p.add_argument("--mb", type=int, default=96)
    p.add_argument("--reads", type=int, default=300)
    p.add_argument("--block-kb", type=int, default=64)
    p.add_argument("--s3fs-python", default="/tmp/s3fs-venv/bin/python")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        print(json.dumps(run_client(args.client, args.url, args.mb, args.reads, args.block_kb << 10)))
        return 0
    rows = []
    for client, python in (("boto3", sys.executable), ("s3fs", args.s3fs_python)):
        if not Path(python).exists():
            print(f"{client}: no {python}; see this script's docstring", file=sys.stderr)
            continue
        proc = subprocess.run(
            [
                python,
                __file__,
                args.url,
                "--mb",
                str(args.mb),
                "--reads",
                str(args.reads),
                "--block-kb",
                str(args.block_kb),
                "--client",
                client,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            print(f"{client}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"{'client':8} {'upload MB/s':>12} {'ms per ranged read':>19}   ({args.mb} MiB upload, "
        f"{args.reads} random {args.block_kb} KiB ranges)"
    )
    for r in rows:
        print(f"{r['client']:8} {r['upload_mb_s']:12.1f} {r['ms_per_read']:19.2f}")
    if len(rows) == 2:
        a, b = rows
        print(
            f"s3fs / boto3: upload time {b['upload_s'] / a['upload_s']:.2f}x, "
            f"ranged read time {b['read_s'] / a['read_s']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
