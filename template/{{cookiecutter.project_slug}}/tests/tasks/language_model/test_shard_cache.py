"""The shard cache of a remote prepared folder (data/remote.py), on fsspec's in-memory filesystem: files verified as
they arrive, the least recently read evicted beyond the bound but never a wanted one, a bad transfer retried then
refused in one line; and a bound too small for the order refused before training."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import fsspec
import numpy as np
import pytest
from helpers import fail_with, train_args
from test_bad_lm_inputs import MANIFEST_CASES  # the same cases as a local folder's

from {{ cookiecutter.package_name }}.data import remote
from {{ cookiecutter.package_name }}.data.remote import CachedShards, ShardCache
from {{ cookiecutter.package_name }}.data.shards import Listed
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import ShardedTokens

SHARDS = [np.arange(i * 50, i * 50 + 50, dtype=np.uint16) for i in range(6)]  # 100 bytes each


@pytest.fixture
def bucket(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[Listed]]]:
    """Six shards in an in-memory folder; its URL and the files as a manifest lists them."""
    memory = fsspec.filesystem("memory")
    root = "/" + re.sub(r"\W", "_", request.node.name)  # a parameter's brackets would read as a glob
    files = []
    for index, shard in enumerate(SHARDS):
        name = f"shard-{index:05d}.bin"
        memory.pipe(f"{root}/{name}", shard.tobytes())
        files.append(Listed(name, shard.nbytes, hashlib.sha256(shard.tobytes()).hexdigest()))
    yield f"memory://{root}", files
    memory.rm(root, recursive=True)


def cached_names(folder: Path) -> set[str]:
    return {path.name.split("-", 1)[1] for path in folder.glob("*-shard-*.bin")}


def test_shards_read_through_the_cache_are_the_remote_bytes_and_the_bound_holds(
    tmp_path: Path, bucket: tuple[str, list[Listed]]
) -> None:
    url, files = bucket
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=300)
    tokens = ShardedTokens(CachedShards(cache, files, np.uint16), lengths=[50] * 6, dtype=np.uint16)
    assert np.array_equal(tokens[40:260], np.concatenate(SHARDS)[40:260])  # shards 0-5 fetched as read
    assert cached_names(cache.folder) <= {f.name for f in files} and len(cached_names(cache.folder)) == 3
    for index in (1, 2, 0):  # read in this order: 1 is now the least recently read
        cache.path(files[index])
        time.sleep(0.01)
    cache.want([files[3], files[5]])  # 3 and 5 are fetched in the background and kept
    deadline = time.monotonic() + 10
    while not {"shard-00003.bin", "shard-00005.bin"} <= cached_names(cache.folder) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {"shard-00003.bin", "shard-00005.bin"} <= cached_names(cache.folder)
    assert sum(path.stat().st_size for path in cache.folder.glob("*-shard-*.bin")) <= 300
    assert "shard-00001.bin" not in cached_names(cache.folder)  # evicted first
    assert not list(cache.folder.glob("*.partial"))


def test_a_transfer_with_other_bytes_is_retried_then_refused_in_one_line(
    tmp_path: Path, bucket: tuple[str, list[Listed]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(remote, "FIRST_PAUSE_S", 0.0)
    url, files = bucket
    damaged = Listed(files[2].name, files[2].size, hashlib.sha256(b"other bytes").hexdigest())
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=1000)
    with pytest.raises(RecipeError, match=r"fetching shard-00002.bin failed 4 times, the last: its bytes do not match"):
        cache.path(damaged)
    assert capsys.readouterr().err.count("data: fetching shard-00002.bin failed") == remote.TRIES - 1
    assert not [*cache.folder.glob("*-shard-00002.bin"), *cache.folder.glob("*.partial")]  # nothing half-written


def test_a_cache_too_small_for_two_groups_of_blocks_is_refused_naming_both_fields(
    tmp_path: Path, bucket: tuple[str, list[Listed]], capsys: pytest.CaptureFixture
) -> None:
    url, files = bucket
    manifest = {
        "format": 1,
        "dtype": "uint16",
        "tokenizer": {"file": "tokenizer.json", "sha256": "0" * 64, "vocab_size": 400},
        "shards": [{"file": f.name, "tokens": 50, "sha256": f.sha256} for f in files],
        "validation": {"first_token": 250, "tokens": 50},
    }
    fsspec.filesystem("memory").pipe(url.removeprefix("memory://") + "/manifest.json", json.dumps(manifest).encode())
    overrides = ["--data.source", "prepared", "--data.path", url, "--data.cache_dir", str(tmp_path / "cache")]
    error = fail_with(train_args(tmp_path / "run", *overrides, "--data.cache_gb", "1e-6"), capsys)
    assert "data.cache_gb=1e-06 is too small for data.shuffle_blocks=8" in error and "3.2e-06 GB" in error
    assert not (tmp_path / "run").exists()


def remote_manifest(url: str, files: list[Listed], **changes: object) -> dict[str, object]:
    """A manifest of the bucket's shards, written beside them, with `changes` on top (a key set to None: dropped)."""
    manifest: dict[str, object] = {
        "format": 1,
        "dtype": "uint16",
        "tokenizer": {"file": "tokenizer.json", "sha256": "0" * 64, "vocab_size": 400},
        "shards": [{"file": f.name, "tokens": 50, "sha256": f.sha256} for f in files],
        "validation": {"first_token": 250, "tokens": 50},
    }
    manifest.update(changes)
    manifest = {key: value for key, value in manifest.items() if value is not None}
    fsspec.filesystem("memory").pipe(url.removeprefix("memory://") + "/manifest.json", json.dumps(manifest).encode())
    return manifest


@pytest.mark.parametrize(
    "digest",
    ["../escaped_dir/x" + "0" * 48, "/tmp/escaped_dir" + "0" * 48, "A" * 64, "0" * 63],
    ids=["a path up and out", "an absolute path", "upper case", "one digit short"],
)
def test_a_manifest_digest_that_is_not_64_lowercase_hex_is_refused_and_nothing_outside_the_cache_is_touched(
    digest: str, tmp_path: Path, bucket: tuple[str, list[Listed]], capsys: pytest.CaptureFixture
) -> None:
    url, files = bucket
    shards = [{"file": f.name, "tokens": 50, "sha256": f.sha256} for f in files]
    shards[0]["sha256"] = digest
    remote_manifest(url, files, shards=shards)
    outside = tmp_path / "escaped_dir"
    outside.mkdir()
    (outside / "x-shard-00000.bin").write_bytes(SHARDS[0].tobytes())  # matching bytes: once read unverified
    (outside / "x-notes.txt").write_text("the user's")
    overrides = ["--data.source", "prepared", "--data.path", url, "--data.cache_dir", str(tmp_path / "cache")]
    error = fail_with(train_args(tmp_path / "run", *overrides), capsys)
    assert f"shard-00000.bin the sha256 {digest[:70]!r}, not 64 lowercase hex digits" in error
    assert sorted(p.name for p in outside.iterdir()) == ["x-notes.txt", "x-shard-00000.bin"]
    assert (outside / "x-notes.txt").read_text() == "the user's"
    assert not (tmp_path / "run").exists()


def test_a_cache_dir_that_is_a_folder_of_the_users_is_refused_and_left_as_it_was(
    tmp_path: Path, bucket: tuple[str, list[Listed]], capsys: pytest.CaptureFixture
) -> None:
    url, files = bucket
    remote_manifest(url, files)
    mine = tmp_path / "documents"
    mine.mkdir()
    (mine / "2024-taxes.pdf").write_bytes(b"%PDF")
    (mine / "meeting-notes.txt").write_text("notes")
    overrides = ["--data.source", "prepared", "--data.path", url, "--data.cache_dir", str(mine)]
    error = fail_with(train_args(tmp_path / "run", *overrides), capsys)
    assert f"the shard cache {str(mine)!r} is a folder that is not empty and not a shard cache" in error
    assert sorted(p.name for p in mine.iterdir()) == ["2024-taxes.pdf", "meeting-notes.txt"]


def test_eviction_deletes_only_the_copies_the_cache_made(tmp_path: Path, bucket: tuple[str, list[Listed]]) -> None:
    url, files = bucket
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=100)
    assert (cache.folder / remote.MARKER).is_file()
    stray = cache.folder / "my-notes.txt"  # a file put there by hand: not a copy, oldest of all
    stray.write_bytes(b"x" * 500)
    os.utime(stray, (0, 0))
    for listed in files[:3]:
        cache.path(listed)
    assert stray.read_bytes() == b"x" * 500
    assert len(list(cache.folder.glob("*-shard-*.bin"))) == 1  # the bound holds for the cache's own copies


def test_a_manifest_larger_than_a_manifest_can_be_is_refused_without_retries(
    tmp_path: Path, bucket: tuple[str, list[Listed]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, files = bucket
    remote_manifest(url, files, padding="x" * 5000)
    monkeypatch.setattr(remote, "SMALL_FILE_BYTES", 4096)
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=1000)
    with pytest.raises(RecipeError, match=r"manifest.json is larger than 0 MiB: not a manifest"):
        cache.fetch_small("manifest.json")
    assert not (cache.folder / "manifest.json").exists()


def test_a_listed_file_with_no_size_larger_than_a_small_file_can_be_is_refused_without_retries(
    tmp_path: Path, bucket: tuple[str, list[Listed]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is listed by its digest alone: a manifest and tokenizer of the same author could make it any size,
    so it is held to the small files' bound as it arrives (its digest matches: only its size is refused)."""
    url, _ = bucket
    huge = b"{" + b" " * 5000 + b"}"
    fsspec.filesystem("memory").pipe(url.removeprefix("memory://") + "/tokenizer.json", huge)
    monkeypatch.setattr(remote, "SMALL_FILE_BYTES", 4096)
    monkeypatch.setattr(remote, "FIRST_PAUSE_S", 5.0)  # a retry would show as seconds
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=1 << 30)
    started = time.monotonic()
    with pytest.raises(RecipeError, match=r"tokenizer\.json is larger than 0 MiB: more than a small file can be"):
        cache.path(Listed("tokenizer.json", None, hashlib.sha256(huge).hexdigest()))
    assert time.monotonic() - started < 5.0
    assert sorted(path.name for path in cache.folder.iterdir()) == [remote.MARKER, "tokenizer.json.lock"]


@pytest.mark.parametrize(
    "refusal",
    [PermissionError("403 Forbidden"), FileNotFoundError("NoSuchKey")],
    ids=["access denied", "no such key"],
)
def test_a_permanent_refusal_of_the_store_is_not_retried(
    refusal: Exception, tmp_path: Path, bucket: tuple[str, list[Listed]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, files = bucket
    cache = ShardCache(url, tmp_path / "cache", bound_bytes=1000)
    calls = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise refusal

    monkeypatch.setattr(cache.fs, "open", refuse)
    monkeypatch.setattr(remote, "FIRST_PAUSE_S", 5.0)  # a retry would show as seconds
    with pytest.raises(RecipeError, match=r"shard-00001\.bin"):
        cache.path(files[1])
    assert len(calls) == 1


def test_a_clients_error_with_a_permanent_code_is_permanent() -> None:
    class ClientError(Exception):
        response: ClassVar[dict] = {"Error": {"Code": "AccessDenied"}}

    assert remote.permanent(ClientError()) and not remote.permanent(ConnectionError("reset"))


def test_data_verify_reads_a_url_as_a_url_and_every_byte_it_lists(
    bucket: tuple[str, list[Listed]], capsys: pytest.CaptureFixture
) -> None:
    from {{ cookiecutter.package_name }}.cli import main

    url, files = bucket
    memory, root = fsspec.filesystem("memory"), url.removeprefix("memory://")
    memory.pipe(f"{root}/tokenizer.json", b"{}")
    tokenizer = {"file": "tokenizer.json", "sha256": hashlib.sha256(b"{}").hexdigest(), "vocab_size": 400}
    remote_manifest(url, files, tokenizer=tokenizer)
    main(["data", "verify", url])
    assert capsys.readouterr().out.startswith(f"{url}: every file matches its manifest: 300 tokens in 6 shard(s)")
    memory.pipe(f"{root}/shard-00003.bin", SHARDS[0].tobytes())  # same size, other bytes
    assert "shard-00003.bin does not match its sha256" in fail_with(["data", "verify", url], capsys)


@pytest.mark.parametrize(("case_id", "change", "message"), MANIFEST_CASES, ids=[case[0] for case in MANIFEST_CASES])
@pytest.mark.parametrize("command", ["train", "data verify"])
def test_a_malformed_manifest_in_a_bucket_is_refused_in_one_line_as_a_local_one_is(
    command: str,
    case_id: str,
    change: dict,
    message: str,
    tmp_path: Path,
    bucket: tuple[str, list[Listed]],
    capsys: pytest.CaptureFixture,
) -> None:
    url, files = bucket
    remote_manifest(url, files, **change)
    if command == "train":
        overrides = ["--data.source", "prepared", "--data.path", url, "--data.cache_dir", str(tmp_path / "cache")]
        argv = train_args(tmp_path / "run", *overrides)
    else:
        argv = ["data", "verify", url]
    assert message in fail_with(argv, capsys)
    assert not (tmp_path / "run").exists()
