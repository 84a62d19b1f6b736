"""Compiles output constraints against the worker's vocabulary, off the engine step.

The scheduler names each distinct constraint once (`SchedulerOutput.grammars_to_compile`) while
its requests wait; compiles run on this worker's compile threads while steps go on, and each
step's output reports those that finished (`take_results`). When a waiting request is then
scheduled its grammar is ready, so `get` returns at once. `get` compiles inline only for a
constraint that was never announced or was evicted since (a worker restarted under a scheduler
that remembers an older compile): a stall of one compile, logged.

Compiled grammars are kept by key, the least recently used dropped past `max_num_cached`. The
tokenizer (and xgrammar's view of the vocabulary) loads on the first compile, on a compile thread.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from services.common.grammars import GrammarError, build_grammar
from services.common.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_NUM_CACHED_GRAMMARS = 512


class GrammarCompiler:
    def __init__(self, tokenizer_path: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_num_cached: int = MAX_NUM_CACHED_GRAMMARS, num_threads: int = 1):
        """`tokenizer_path` None: a model without a tokenizer, whose constraints all fail to compile."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_cached = max_num_cached
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[str, Future] = OrderedDict()  # key -> compiled grammar, LRU order
        self._pending: set[str] = set()  # submitted, not yet reported
        self._xgr_compiler: Any = None
        self._init_lock = threading.Lock()

    def warm_up(self) -> None:
        """Loads the tokenizer and xgrammar's vocabulary view on the compile thread now, so the
        first constrained request does not wait for them (about 0.5 s for SmolLM2's)."""
        self._executor.submit(self._warm_up)

    def _warm_up(self) -> None:
        try:
            self._compiler()
        except GrammarError as exc:  # said again, to its request, by the first compile
            logger.info("structured outputs unavailable on this model: %s", exc)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def submit(self, grammars: dict[str, StructuredOutputsParams]) -> None:
        """Starts compiling each grammar not compiled or compiling already; all are reported later."""
        for key, params in grammars.items():
            self._future(key, params)
            self._pending.add(key)

    def take_results(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, str]]:
        """Keys reported since the last call: (compiled, {failed key: why}). With `wait_s`, waits up
        to that long for a first compile to finish (the worker has nothing else to do)."""
        if not self._pending:
            return [], {}
        futures = [self._futures[k] for k in self._pending if k in self._futures]
        if wait_s > 0 and futures and not any(f.done() for f in futures):
            wait(futures, timeout=wait_s, return_when=FIRST_COMPLETED)
        compiled, failed = [], {}
        for key in list(self._pending):
            future = self._futures.get(key)
            if future is None:  # evicted before it was reported: compiled again when scheduled
                self._pending.discard(key)
                compiled.append(key)
                continue
            if not future.done():
                continue
            self._pending.discard(key)
            error = future.exception()
            if error is None:
                compiled.append(key)
            else:
                failed[key] = str(error)
                del self._futures[key]  # a failure is not cached: the same text fails again, quickly
        return compiled, failed

    def get(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (xgrammar CompiledGrammar); raises GrammarError if it does not compile."""
        key = params.key
        future = self._futures.get(key)
        if future is None or not future.done():
            if future is None:
                logger.warning("compiling a grammar inline, in the step (it was not announced or was evicted)")
            future = self._future(key, params)
        try:
            return future.result()
        except GrammarError:
            self._futures.pop(key, None)
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _future(self, key: str, params: StructuredOutputsParams) -> Future:
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
            return future
        future = self._executor.submit(self._compile, params)
        self._futures[key] = future
        while len(self._futures) > self.max_num_cached:
            self._futures.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler()
        grammar = build_grammar(params)
        try:
            return compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise GrammarError(f"the grammar does not compile: {exc}") from None

    def _compiler(self) -> Any:
        with self._init_lock:
            if self._xgr_compiler is None:
                if self.tokenizer_path is None:
                    raise GrammarError("this worker's model has no tokenizer, which structured outputs need")
                import xgrammar as xgr
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_path), local_files_only=True)
                except (OSError, ValueError) as exc:
                    raise GrammarError(f"the model's tokenizer, which structured outputs need, does not load: "
                                       f"{exc}") from None
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.eos_token_ids) or None)
                # Our cache above keeps compiled grammars; xgrammar's own would hold them twice.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler
