"""A prepared folder in S3 (moto's server on localhost), written there by `prepare --out s3://...` and read through a
shard cache smaller than the corpus: the losses of the same folder read locally, a killed run resumed bitwise, a
dropped connection retried."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from corpus import write_corpus
from helpers import final_weights, losses_by_run, run_cli, train_args
from s3 import CuttingProxy, s3_server

pytestmark = pytest.mark.slow
MAX_STEPS = 12
KILL_AT, RESUMES_AT = 7, 4
SHARD_BYTES = 500 * 2  # --shard_tokens 500 of uint16
CACHE_GB = 5 * SHARD_BYTES / 1e9  # five shards: two groups of data.shuffle_blocks=1 block need four
URL = "s3://corpora/demo"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("corpus")
    write_corpus(raw)
    return raw


def prepare_args(corpus: Path, out: str, *tokenizer: str) -> list[str]:
    return ["prepare", str(corpus), "--out", out, *tokenizer, "--val_fraction", "0.1", "--shard_tokens", "500",
            "--workers", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    result = run_cli(*prepare_args(corpus, str(out), "--train_tokenizer", "400"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) > 8  # the cache holds five
    return out


@pytest.fixture
def bucket(prepared: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`prepare --out s3://corpora/demo` of the same corpus with the local folder's tokenizer; the environment
    points S3 clients (prepare's and the runs') at moto's server."""
    import s3fs

    with s3_server() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        for name, value in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")]:
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        s3 = s3fs.S3FileSystem(skip_instance_cache=True)
        s3.mkdir("corpora")
        result = run_cli(*prepare_args(corpus, URL, "--tokenizer", str(prepared / "tokenizer.json")))
        assert result.returncode == 0, result.stderr[-3000:]
        for shard in sorted(prepared.glob("shard-*.bin")):  # the same bytes as the local folder's
            assert s3.cat_file(f"{URL}/{shard.name}") == shard.read_bytes(), shard.name
        yield endpoint


def overrides(data: str, cache: Path) -> list[str]:
    return [
        "--strategy.name", "ddp", "--data.source", "prepared", "--data.path", data, "--data.shuffle_blocks", "1",
        "--data.cache_dir", str(cache), "--data.cache_gb", str(CACHE_GB), "--model.vocab_size", "400",
        "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", str(RESUMES_AT),
        "--eval.every_steps", "6", "--checkpoint.resume", "auto",
    ]  # fmt: skip


def test_training_from_s3_matches_the_local_folder_resumes_bitwise_and_retries_a_dropped_download(
    tmp_path: Path, prepared: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    local = run_cli(*train_args(tmp_path / "local", *overrides(str(prepared), tmp_path / "unused")))
    assert local.returncode == 0, local.stderr[-3000:]
    (expected_losses,) = losses_by_run(tmp_path / "local")
    assert sorted(expected_losses) == list(range(1, MAX_STEPS + 1))

    # The first run reads through a proxy that drops the connection of every GET of one training shard as many
    # times as s3fs retries by itself: the cache's own retry is what gets the shard.
    proxy = CuttingProxy(int(bucket.rsplit(":", 1)[1]), b"/shard-00003.bin", cuts=s3fs.S3FileSystem.retries)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    run, cache = tmp_path / "remote", tmp_path / "cache"
    killed = run_cli(*train_args(run, *overrides(URL, cache)), fault=f"kill-at-step:{KILL_AT}")
    proxy.close()
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert proxy.cut == s3fs.S3FileSystem.retries
    assert "data: fetching shard-00003.bin failed" in killed.stderr and "retry 1 of 3" in killed.stderr

    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket)
    resumed = run_cli(*train_args(run, *overrides(URL, cache)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{RESUMES_AT:08d} at step {RESUMES_AT}" in resumed.stdout

    before_kill, after_resume = losses_by_run(run)
    assert before_kill == {step: expected_losses[step] for step in range(1, KILL_AT + 1)}  # floats compared exactly
    assert after_resume == {step: expected_losses[step] for step in range(RESUMES_AT + 1, MAX_STEPS + 1)}
    expected, weights = final_weights(tmp_path / "local", MAX_STEPS), final_weights(run, MAX_STEPS)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)

    # Shards were evicted: the bound held, give or take the one group (two shards here) that a rank still reading it
    # keeps while the other has moved on.
    cached = sum(path.stat().st_size for path in cache.iterdir() if path.name.endswith(".bin"))
    assert 0 < cached <= CACHE_GB * 1e9 + 2 * SHARD_BYTES < sum(path.stat().st_size for path in prepared.glob("*.bin"))
    assert not list(cache.glob("*.partial"))

    # `sample` decodes with the remote folder's tokenizer (fetched through the cache): the local run's text.
    prompt = ["--prompt", "The fox", "--max_new_tokens", "8", "--temperature", "0"]
    samples = [run_cli("sample", str(folder), *prompt) for folder in (run, tmp_path / "local")]
    assert all(result.returncode == 0 for result in samples), samples[0].stderr[-2000:]
    assert samples[0].stdout.startswith("The fox") and samples[0].stdout == samples[1].stdout
