"""Turns a `StructuredOutputsParams` into an xgrammar `Grammar` (parsing only: no vocabulary).

The frontend calls it to refuse a constraint that does not parse before the request reaches the
engine; the worker calls it again to compile the grammar against its vocabulary. xgrammar imports
torch, so neither the scheduler nor module import time touches this module's import of it.
"""
from __future__ import annotations

import json
from typing import Any

from services.common.structured_outputs import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint that does not parse; the message says why."""


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar Grammar for `params`; raises GrammarError if it does not parse."""
    import xgrammar as xgr

    kind, spec = params.kind, params.spec
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=params.any_whitespace, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=params.any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_literal, _choices(spec))))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "structural_tag":
            return _structural_tag(xgr, spec)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parsers raise RuntimeError
        raise GrammarError(_clean(str(exc))) from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


def _choices(spec: str) -> list[str]:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty array of non-empty strings")
    return choices


def _ebnf_literal(text: str) -> str:
    # xgrammar's EBNF string literals take JSON's escapes.
    return json.dumps(text, ensure_ascii=False)


def _structural_tag(xgr: Any, spec: str) -> Any:
    """vLLM's form ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) or xgrammar's
    own structural tag JSON."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
            raise GrammarError("a structural tag needs non-empty 'structures' and 'triggers' arrays")
        items = []
        for i, s in enumerate(structures):
            if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")) \
                    or not isinstance(s.get("schema"), dict):
                raise GrammarError(f"structures[{i}] needs string 'begin' and 'end' and an object 'schema'")
            items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]))
        if not all(isinstance(t, str) and t for t in triggers):
            raise GrammarError("triggers must be non-empty strings")
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(spec)


def _clean(message: str) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; keep what they say."""
    message = message.strip()
    if message.startswith("[") and ": " in message:
        head, _, rest = message.partition(": ")
        if "/" in head or ".cc" in head:
            return rest.strip()
    return message
