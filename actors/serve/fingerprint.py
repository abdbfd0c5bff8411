"""`system_fingerprint`: which engine, model and backend wrote an answer, as OpenAI's replies
carry it (the same string while nothing of these changes, so a client can tell when the
answers of one seed may differ)."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

# How much of each end of a model file its digest reads: the start holds the GGUF header
# (metadata, every tensor's name, type and offset), the end the last weights.
DIGEST_SPAN = 1 << 20


def engine_version() -> str:
    try:
        return importlib.metadata.version("q4k-actors")
    except importlib.metadata.PackageNotFoundError:
        return "source"  # run from a source tree, not installed


ENGINE_VERSION = engine_version()


def model_digest(path: Path) -> str:
    """A SHA-256 digest of a model file's size and of its first and last MiB: it changes with
    the file, and takes milliseconds whatever the file's size."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as file:
        digest.update(file.read(DIGEST_SPAN))
        file.seek(max(0, size - DIGEST_SPAN))
        digest.update(file.read(DIGEST_SPAN))
    return digest.hexdigest()


def name_digest(name: str) -> str:
    """The digest that stands for a model known only by its name."""
    return hashlib.sha256(name.encode()).hexdigest()


def system_fingerprint(digest: str, on_gpu: bool) -> str:
    """`fp_q4k-<engine version>-<backend>-<model digest, 10 hex digits>`."""
    return f"fp_q4k-{ENGINE_VERSION}-{'cuda' if on_gpu else 'cpu'}-{digest[:10]}"
