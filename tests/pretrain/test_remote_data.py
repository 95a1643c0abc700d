"""The trainer reading its shards from object storage (issue 35): `data.dir=s3://...` against the
tests' real S3 server (SeaweedFS), and `https://`-style through its filer's own HTTP (Range honoured).

A block is one ranged GET at the manifest's offsets, checked as a local block is; the same samples
in the same order, so the per-step losses equal a local run's bit for bit."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import explain, train
from s3_server import SECRET

pytestmark = pytest.mark.slow
RUN = [
    "train.max_steps=3",
    "train.log_every=1",
    "train.eval_every=3",
    "train.eval_sequences=32",
    "train.checkpoint_every=0",
    "model.max_position_embeddings=64",
]


def logged(out_dir: Path) -> list[tuple[int, str, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in ("train/loss", "eval/loss") if k in r]


@pytest.fixture(scope="module")
def bucket_copy(s3_server, shards):
    """The ``shards`` fixture's folder, object for object, in a bucket."""
    bucket, client = s3_server.bucket("train"), s3_server.client()
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
    return bucket


@pytest.fixture(scope="module")
def local_losses(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("local_run")
    proc = train(shards, out, *RUN, ranks=2)
    assert proc.returncode == 0, explain(proc)
    return logged(out)


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_two_ranks_reading_a_bucket_log_the_losses_of_the_local_folder(
    s3_server, bucket_copy, local_losses, tmp_path, scheme
):
    url = f"s3://{bucket_copy}/wiki" if scheme == "s3" else f"{s3_server.filer}/buckets/{bucket_copy}/wiki"
    proc = train(url, tmp_path / "run", *RUN, f"data.cache_dir={tmp_path / 'cache'}", ranks=2, env=s3_server.aws())
    assert proc.returncode == 0, explain(proc)
    assert logged(tmp_path / "run") == local_losses
    assert [k for _, k, _ in local_losses].count("eval/loss") == 1
    assert SECRET not in proc.stdout + proc.stderr
    exported = tmp_path / "run" / "hf_final"
    assert (exported / "tokenizer.json").is_file() and (exported / "model.safetensors").is_file()


def copy_to_bucket(s3_server, shards: Path, stem: str) -> str:
    bucket, client = s3_server.bucket(stem), s3_server.client()
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"wiki/{path.relative_to(shards)}", Body=path.read_bytes())
    return bucket


def test_a_denied_key_is_exit_2_before_any_rank_starts(s3_server, bucket_copy, tmp_path):
    url = f"s3://{bucket_copy}/wiki"
    proc = train(url, tmp_path / "run", *RUN, ranks=2, env={**s3_server.aws(), "AWS_SECRET_ACCESS_KEY": "wrong"})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and f"data.dir: {url}/manifest.json: access denied (" in said, explain(proc)
    assert "Traceback" not in said and SECRET not in said and not (tmp_path / "run" / "checkpoints").exists()


def test_a_shard_object_replaced_with_other_bytes_is_exit_2_naming_it(s3_server, shards, tmp_path):
    bucket = copy_to_bucket(s3_server, shards, "replaced")
    client = s3_server.client()
    victims = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="wiki/train-")["Contents"]]
    for key in victims:  # every train shard: whichever is read first
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        client.put_object(Bucket=bucket, Key=key, Body=data[:1024] + bytes(reversed(data[1024:])))
    proc = train(
        f"s3://{bucket}/wiki",
        tmp_path / "run",
        *RUN,
        f"data.cache_dir={tmp_path / 'cache'}",
        ranks=2,
        env=s3_server.aws(),
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert f"s3://{bucket}/wiki/train-" in said and ": block " in said and "Traceback" not in proc.stderr, said[-3000:]


def shifted_ids(data: bytes) -> bytes:
    """A shard's bytes with every block's token ids moved down by one: the same size, tar headers,
    shapes and dtype, every id in range. It decodes and trains; only its content differs."""
    out = bytearray(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".input_ids.npy"):
                ids = np.load(io.BytesIO(data[member.offset_data : member.offset_data + member.size]))
                buf = io.BytesIO()
                np.save(buf, np.where(ids > 5, ids - 1, ids).astype(ids.dtype))
                assert len(buf.getvalue()) == member.size
                out[member.offset_data : member.offset_data + member.size] = buf.getvalue()
    return bytes(out)


@pytest.mark.parametrize("cache", ["off", "fresh"])
def test_a_shard_replaced_by_one_that_still_decodes_is_exit_2_naming_the_block(s3_server, shards, tmp_path, cache):
    """Before block checksums, such a run exited 0 having trained on the replaced data: ranged reads
    were not checked, and the pre-flight check compares sizes only. With the cache off every block is a
    ranged GET; with a fresh cache the first blocks are ranged GETs while the shard downloads."""
    bucket = copy_to_bucket(s3_server, shards, f"decodable-{cache}")
    client = s3_server.client()
    for key in [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="wiki/train-")["Contents"]]:
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        client.put_object(Bucket=bucket, Key=key, Body=shifted_ids(data))
    settings = ["data.cache_limit_gb=0"] if cache == "off" else [f"data.cache_dir={tmp_path / 'cache'}"]
    proc = train(f"s3://{bucket}/wiki", tmp_path / "run", *RUN, *settings, ranks=2, env=s3_server.aws())
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert re.search(
        rf"s3://{bucket}/wiki/train-[\w-]+\.tar: block \d+: its bytes are not those data prep wrote", said
    ), said[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_a_mixture_from_a_bucket_reads_each_micro_batch_ahead_and_gives_the_local_batches(
    s3_server, two_sources, monkeypatch
):
    """``data.sources`` in a bucket: every block a micro-batch gathers (after the first) was asked for
    by the look-ahead of an earlier one, and the batches are the local folders' bytes for bytes."""
    import numpy as np

    from data_prep.common.manifest import load_manifest
    from pretrain.data.mixture import MixtureStream, Source
    from pretrain.data.shard_reader import BlockReader

    bucket, client = s3_server.bucket("mix"), s3_server.client()
    for name, folder in two_sources.items():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.put_object(Bucket=bucket, Key=f"{name}/{path.relative_to(folder)}", Body=path.read_bytes())
    for key, value in s3_server.aws().items():
        monkeypatch.setenv(key, value)

    def batches(where: dict[str, str], n: int = 12) -> list[dict]:
        sources = [Source(name, where[name], w) for name, w in (("big", 0.8), ("small", 0.2))]
        stream = MixtureStream(sources, [load_manifest(s.dir) for s in sources], "train", 1, 2, 8, 32, 5)
        it = iter(stream)
        return [next(it) for _ in range(n)]

    local = batches({name: str(folder) for name, folder in two_sources.items()})
    asked, late = {}, []
    prefetch, gather = BlockReader.prefetch, BlockReader.gather

    def recording_prefetch(self, blocks):
        asked.setdefault(id(self), set()).update(map(int, blocks))
        prefetch(self, blocks)

    def checking_gather(self, blocks, rows):
        if asked:  # the first micro-batch has nothing before it to ask ahead
            late.extend(sorted(set(map(int, blocks)) - asked.get(id(self), set())))
        return gather(self, blocks, rows)

    monkeypatch.setattr(BlockReader, "prefetch", recording_prefetch)
    monkeypatch.setattr(BlockReader, "gather", checking_gather)
    remote = batches({name: f"s3://{bucket}/{name}" for name in two_sources})
    assert not late, f"blocks gathered without read-ahead: {late}"
    for a, b in zip(local, remote, strict=True):
        assert (a["global_step"], a["micro_step"]) == (b["global_step"], b["micro_step"])
        for key in ("input_ids", "word_starts", "sample_ids", "source"):
            assert np.array_equal(a[key].numpy(), b[key].numpy()), key
