"""A request's output constraint (vLLM's `StructuredOutputsParams`), as every service sees it.

One constraint per request, of one kind:
- `json`: a JSON schema (its JSON text); `json_object`: any JSON object (spec empty);
- `regex`: a regular expression the whole output must match;
- `choice`: one of a list of strings (the list's JSON text);
- `grammar`: an EBNF grammar in xgrammar's dialect (GBNF-like, `root ::= ...`);
- `structural_tag`: xgrammar's structural tag (its JSON text): free text with constrained tagged
  regions, as tool calls inside `<tool_call>...</tool_call>`.

The frontend checks the constraint parses (`frontend/structured_outputs.py`); the worker compiles
it against the vocabulary and keeps one matcher per request. `key` names a compiled grammar: equal
constraints share one compile.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A constraint's text is parsed and compiled per distinct key; beyond this it is refused.
MAX_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    kind: str
    spec: str = ""
    # JSON kinds: allow any whitespace between tokens (False: the compact form only, which keeps
    # small models from looping on newlines).
    any_whitespace: bool = False

    @property
    def key(self) -> str:
        """A string that identifies the compiled grammar (kind, options, spec)."""
        return f"{self.kind}:{int(self.any_whitespace)}:{self.spec}"


def structured_outputs_violation(params: StructuredOutputsParams) -> str | None:
    """The engine's check of a constraint's envelope (the frontend parses it in full)."""
    if params.kind not in KINDS:
        return f"unknown structured output kind {params.kind!r}; expected one of {', '.join(KINDS)}"
    if len(params.spec) > MAX_SPEC_CHARS:
        return f"the structured output constraint has {len(params.spec)} characters; at most {MAX_SPEC_CHARS}"
    if params.kind != "json_object" and not params.spec:
        return f"the {params.kind} constraint is empty"
    return None
