"""`python -m services.common.model_fetch`: puts a model on a volume once, and waits for it.

    fetch --source SRC --model-dir DIR [--revision REV] [--gguf-file NAME] [--tokenizer-root ROOT]
    wait --dir DIR [--timeout-s S] [--poll-interval-s S]

`fetch` makes DIR a Hugging Face folder (config.json, safetensors weights, tokenizer files) from
SRC: a Hugging Face repository id (downloaded: config, weights, tokenizer and chat templates only),
a local Hugging Face folder (copied), or a `.gguf` file, local or, with `--gguf-file`, one file of a
repository (converted to safetensors as `model_files.convert_gguf` does). With `--tokenizer-root`
it also copies the small files a frontend reads (tokenizer, chat templates, config.json,
generation_config.json; never weights) into ROOT/<DIR's name>: mounted where the model folder's
parent would be, that folder stands in for the model folder, so a frontend can serve without the
weights volume.

Each folder is built beside its final place and renamed into it, so a folder that exists is
complete; `fetch` leaves an existing folder as it is (a new model or revision goes to a new
folder), which makes a rerun of the Kubernetes Job cheap. One writer at a time (the Job runs one
pod): leftover temporary folders are taken for those of a killed run and removed.

`wait` returns once DIR holds a complete folder (its config.json): the init containers of the
engine and frontend pods run it, so pods can be applied together with the Job that fills the volume.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from services.common.model_files import convert_gguf

logger = logging.getLogger(__name__)

# What a frontend reads from a model folder: `AutoTokenizer` (tokenizer and its config, special
# tokens, vocabularies of slow tokenizers, chat templates), `resolve_model` (config.json), EOS ids
# and sampling defaults (config.json, generation_config.json).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",  # SentencePiece
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
TOKENIZER_PATTERNS = ("*.jinja", "*.tiktoken")
TOKENIZER_DIRS = ("additional_chat_templates",)  # named chat templates (transformers >= 4.54)
# What a repository download takes: everything above plus safetensors weights and their index;
# never the duplicate `original/` checkpoints or pickled weights some repositories also carry.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
DOWNLOAD_IGNORE = ("original/*",)
DEFAULT_POLL_INTERVAL_S = 5.0


def is_complete(folder: Path) -> bool:
    """A folder this module published (or any Hugging Face folder): config.json is there."""
    return (folder / "config.json").is_file()


def fetch_model(source: str, model_dir: Path, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """Makes `model_dir` a Hugging Face folder from `source`, unless it is complete already."""
    source_path = Path(source).expanduser()
    if source_path.is_dir():
        build = _copy_folder(source_path)
    elif source_path.is_file() and source_path.suffix == ".gguf":
        build = _convert(source_path)
    elif source_path.exists():
        raise ValueError(f"--source {source}: expected a Hugging Face folder, a .gguf file or a repository id")
    elif gguf_file:
        build = _download_gguf(source, gguf_file, revision)
    else:
        build = _download_snapshot(source, revision)
    return _publish(model_dir, build)


def write_tokenizer_dir(model_dir: Path, tokenizer_dir: Path) -> Path:
    """Copies the tokenizer files of `model_dir` into `tokenizer_dir`, unless it is complete already."""
    if not is_complete(model_dir):
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model folder")

    def build(tmp: Path) -> None:
        names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
        names += sorted({p.name for pattern in TOKENIZER_PATTERNS for p in model_dir.glob(pattern)
                         if p.is_file()} - set(names))
        if not any(n not in ("config.json", "generation_config.json") for n in names):
            raise FileNotFoundError(f"no tokenizer files in {model_dir}")
        for name in names:
            shutil.copyfile(model_dir / name, tmp / name)
        for name in TOKENIZER_DIRS:
            if (model_dir / name).is_dir():
                shutil.copytree(model_dir / name, tmp / name)

    return _publish(tokenizer_dir, build)


def wait_for_model(folder: Path, timeout_s: float | None = None, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> bool:
    """True once `folder` is complete; False when `timeout_s` (None: no limit) passes first."""
    deadline = None if timeout_s is None else clock() + timeout_s
    while not is_complete(folder):
        if deadline is not None and clock() >= deadline:
            return False
        sleep(poll_interval_s)
    return True


def _publish(folder: Path, build: Callable[[Path], None]) -> Path:
    """Runs `build` on a temporary folder beside `folder` and renames it into place."""
    if is_complete(folder):
        logger.info("%s is complete already; left as it is", folder)
        return folder
    if folder.exists():
        raise FileExistsError(f"{folder} exists but has no config.json: remove it, or choose another folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        build(tmp)
        if not is_complete(tmp):
            raise FileNotFoundError(f"the source of {folder} has no config.json: not a Hugging Face model")
        _make_readable(tmp)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s", folder)
    return folder


def _copy_folder(source: Path) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        shutil.copytree(source, tmp, dirs_exist_ok=True)

    return build


def _convert(gguf_path: Path) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        convert_gguf(gguf_path, tmp)

    return build


def _download_snapshot(repo_id: str, revision: str | None) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        from huggingface_hub import snapshot_download  # reads HF_TOKEN and HF_ENDPOINT itself

        snapshot_download(repo_id, revision=revision, local_dir=tmp, allow_patterns=list(DOWNLOAD_PATTERNS),
                          ignore_patterns=list(DOWNLOAD_IGNORE))
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # the download's own bookkeeping

    return build


def _download_gguf(repo_id: str, filename: str, revision: str | None) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        from huggingface_hub import hf_hub_download

        # The GGUF file waits beside the output, on the same volume (it can be tens of GB).
        with tempfile.TemporaryDirectory(prefix=f"{tmp.name}-gguf-", dir=tmp.parent) as download:
            path = Path(hf_hub_download(repo_id, filename, revision=revision, local_dir=download))
            convert_gguf(path, tmp)

    return build


def _make_readable(folder: Path) -> None:
    # mkdtemp and some writers create owner-only files; pods running as another uid read them too.
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.common.model_fetch",
                                     description="put a model on a volume once, or wait until it is there")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download, copy or convert a model into --model-dir")
    fetch.add_argument("--source", required=True,
                       help="a Hugging Face repository id, a Hugging Face folder, or a .gguf file")
    fetch.add_argument("--model-dir", required=True, type=Path, help="the model folder to create")
    fetch.add_argument("--revision", default="", help="branch, tag or commit of a repository (default: main)")
    fetch.add_argument("--gguf-file", default="", help="with a repository id: the .gguf file of it to convert")
    fetch.add_argument("--tokenizer-root", default="", help="also copy the tokenizer files to ROOT/<model folder name>")
    wait = commands.add_parser("wait", help="return once --dir holds a complete model folder")
    wait.add_argument("--dir", required=True, type=Path, help="the folder to wait for")
    wait.add_argument("--timeout-s", type=float, default=0.0, help="give up after this many seconds (0: never)")
    wait.add_argument("--poll-interval-s", type=float, default=DEFAULT_POLL_INTERVAL_S, help="seconds between looks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "wait":
        logger.info("waiting for %s", args.dir)
        if not wait_for_model(args.dir, args.timeout_s or None, args.poll_interval_s):
            print(f"model_fetch: {args.dir} is still incomplete after {args.timeout_s:.0f} s", file=sys.stderr)
            return 1
        return 0
    try:
        fetch_model(args.source, args.model_dir, args.revision or None, args.gguf_file or None)
        if args.tokenizer_root:
            write_tokenizer_dir(args.model_dir, Path(args.tokenizer_root) / args.model_dir.name)
    except (OSError, ValueError) as exc:
        print(f"model_fetch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
