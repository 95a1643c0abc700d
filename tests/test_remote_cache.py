"""The node's cache of whole shards of a remote data.dir (issue 35, pretrain/data/shard_cache.py):
one download per shard for a node's ranks, none with a warm cache, and eviction at its limit."""
from __future__ import annotations


import pytest

from conftest import explain, train
from test_remote_data import copy_to_bucket, logged

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bucket_copy(s3_server, shards):
    return copy_to_bucket(s3_server, shards, "cache")


def test_a_nodes_ranks_download_each_shard_once_and_a_warm_cache_downloads_none(s3_server, bucket_copy, shards,
                                                                                 tmp_path):
    """Two ranks with a loader worker each, into a second epoch: each shard downloaded once for the
    node (checked against its sha256, named by it), later reads from the copy; a second run with the
    cache warm downloads nothing and logs the cold run's losses bit for bit (the tests above compare a
    bucket's losses with the local folder's)."""
    import hashlib

    cache = tmp_path / "cache"
    # 64 a step: an epoch of the 1,927 sequences is 30 steps, so 35 go into the second
    args = ["train.max_steps=35", "train.global_batch_size=64", "train.log_every=1", "train.eval_every=0",
            "train.checkpoint_every=0", "model.max_position_embeddings=64", "impl.num_workers=1",
            f"data.cache_dir={cache}"]
    url = f"s3://{bucket_copy}/wiki"
    first = train(url, tmp_path / "cold", *args, ranks=2, env=s3_server.aws())
    assert first.returncode == 0, explain(first)
    log = (cache / "downloads.log").read_text().splitlines()
    downloaded = [line.split()[2] for line in log]
    assert downloaded and len(downloaded) == len(set(downloaded)), log
    assert all(u.startswith(f"{url}/") and u.endswith(".tar") for u in downloaded)
    for path in cache.glob("*.tar"):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.stem
    second = train(url, tmp_path / "warm", *args, ranks=2, env=s3_server.aws())
    assert second.returncode == 0, explain(second)
    assert (cache / "downloads.log").read_text().splitlines() == log
    assert logged(tmp_path / "cold") == logged(tmp_path / "warm")
    assert len(logged(tmp_path / "cold")) >= 35


def test_the_cache_keeps_to_its_limit_by_evicting_the_least_recently_used(s3_server, bucket_copy, tmp_path,
                                                                          monkeypatch):
    import os

    from data_prep.shard_format import load_manifest
    from data_prep.storage import open_store
    from pretrain.data.shard_cache import ShardCache

    for key, value in s3_server.aws().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{bucket_copy}/wiki"
    store, manifest = open_store(url), load_manifest(url)
    a, b, c = sorted(manifest.shards_of("train"), key=lambda e: e.name)[:3]
    cache = ShardCache(tmp_path / "cache", limit_bytes=a.bytes + b.bytes)
    cache.fetch(store, a)
    cache.fetch(store, b)
    os.utime(cache.path(a), (1, 1))                      # a: used long ago
    assert cache.lookup(b) is not None
    cache.fetch(store, c)                                # over the limit: a goes, b (used) and c stay
    assert not cache.path(a).exists() and cache.path(b).is_file() and cache.path(c).is_file()
    assert cache.lookup(a) is None
    cache.fetch(store, c)                                # present: no second download
    assert [line.split()[2].rsplit("/", 1)[1] for line in (tmp_path / "cache" / "downloads.log").read_text().splitlines()] \
        == [a.name, b.name, c.name]
