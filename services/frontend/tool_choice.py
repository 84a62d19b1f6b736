"""Reads a chat request's `tools`, `tool_choice` and `parallel_tool_calls`.

- `none`: the tools are not shown to the model and no call is parsed;
- `auto` (the default when tools are given): the model decides; its output is parsed by the
  server's tool-call parser (`--tool-call-parser`);
- `required` and a named function are forced with constrained decoding, so any model returns
  arguments that validate: a named function's output is its arguments object, constrained by the
  function's `parameters` schema; `required`'s is a JSON array of `{"name", "parameters"}` calls
  (one at most when `parallel_tool_calls` is false), each constrained by its function's schema.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.errors import invalid_request

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_NUM_TOOLS = 128


@dataclass(frozen=True)
class ToolChoice:
    tools: tuple[dict[str, Any], ...]  # the request's tools, as sent (type "function")
    mode: str  # "none", "auto", "required" or "named"
    function_name: str | None = None  # the named function
    parallel_tool_calls: bool = True

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def renders_tools(self) -> bool:
        return self.mode != "none"

    def forced_constraint(self) -> StructuredOutputsParams:
        """The JSON schema the forced output must follow."""
        if self.mode == "named":
            schema = _parameters(self._function(self.function_name))
        else:
            calls = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                                      "parameters": _parameters(f["function"])},
                      "required": ["name", "parameters"]} for f in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
        return StructuredOutputsParams("json", json.dumps(schema, ensure_ascii=False))

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parse_tool_choice(body: dict[str, Any]) -> ToolChoice | None:
    """None when the request has no tools (a `tool_choice` other than none then is refused)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request("'tool_choice' needs 'tools'.", param="tool_choice")
        if tools is not None and not isinstance(tools, list):
            raise invalid_request("'tools' must be an array.", param="tools")
        return None
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array.", param="tools")
    if len(tools) > MAX_NUM_TOOLS:
        raise invalid_request(f"At most {MAX_NUM_TOOLS} tools.", param="tools")
    names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise invalid_request("Tool function names must be unique.", param="tools")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(tuple(tools), choice or "auto", parallel_tool_calls=parallel)
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise invalid_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
    name = choice["function"].get("name")
    if name not in names:
        raise invalid_request(f"tool_choice names function {name!r}, which is not among the tools.",
                              param="tool_choice.function.name")
    return ToolChoice(tuple(tools), "named", name, parallel)


def _check_tool(i: int, tool: Any) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}.", param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'.",
                              param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_request(f"{where}.function.description must be a string.", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid_request(f"{where}.function.parameters must be a JSON schema object.",
                              param=f"{where}.function.parameters")
    return name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}
