"""GetTokenizer's bundle: the served model folder's tokenizer files as one ZIP, sent in 64 KiB
chunks with the SHA-256 (hex) of the whole ZIP on the last one.

The files are what `transformers.AutoTokenizer` and the gateway's tokenizer need to rebuild the
tokenizer and its chat template elsewhere: the tokenizer itself (`tokenizer.json`, or the slow
tokenizers' vocabularies), its config and special tokens, chat templates, and the model's
`config.json` / `generation_config.json` (model type, EOS ids). Weights never go. The ZIP is built
once, on a thread, and kept: a model folder does not change while it is served.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from services.common.model_fetch import TOKENIZER_FILES, TOKENIZER_PATTERNS

CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class TokenizerZip:
    data: bytes
    sha256: str  # hex digest of `data`
    names: tuple[str, ...]  # the files inside, in order

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """(bytes, sha256) pairs: the digest on the last chunk only, "" before it."""
        for start in range(0, len(self.data), CHUNK_BYTES):
            end = start + CHUNK_BYTES
            yield self.data[start:end], self.sha256 if end >= len(self.data) else ""


def build_tokenizer_zip(model_dir: Path) -> TokenizerZip:
    """Raises FileNotFoundError when the folder has no tokenizer file."""
    names = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    for pattern in TOKENIZER_PATTERNS:
        names += sorted(p.name for p in model_dir.glob(pattern) if p.is_file() and p.name not in names)
    if not any(name not in ("config.json", "generation_config.json") for name in names):
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(model_dir / name, name)
    data = buffer.getvalue()
    return TokenizerZip(data, hashlib.sha256(data).hexdigest(), tuple(names))


class TokenizerBundle:
    """The model folder's ZIP, built on first use (off the event loop) and kept."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._zip: TokenizerZip | None = None
        self._lock = asyncio.Lock()  # concurrent first calls build it once

    async def get(self) -> TokenizerZip:
        async with self._lock:
            if self._zip is None:
                self._zip = await asyncio.to_thread(build_tokenizer_zip, self.model_dir)
            return self._zip
