"""Structured output and forced tool calls at the gateway: the request's fields read into one
protocol GrammarSpec, compiled once here so a broken spec is an HTTP 400 that says why.

Accepted, as vLLM and OpenAI define them (at most one constraint per request):

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM ``structured_outputs``: ``{"json": schema, "regex": str, "choice": [str],
  "grammar": str, "json_object": true}`` (exactly one key set), and the older extras
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark, or GBNF
  converted to Lark);
- chat ``tools`` with ``tool_choice``: ``"none"`` (plain text), ``"required"`` (a JSON array
  of one or more calls ``{"name", "parameters"}``, vLLM's schema) or ``{"type": "function",
  "function": {"name": ...}}`` (the named function's parameters object); the output is
  returned as ``message.tool_calls`` (:func:`tool_calls`). ``"auto"`` (OpenAI's default with
  tools) needs the model's chat template to define tool calling and a parser of its format:
  this server has no such parser, so it is refused with a 400 that says so.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specmesh.engine.grammar import GrammarCompiler, gbnf_to_lark, lark_choice
from specmesh.gateway.api_errors import bad_request
from specmesh.protocol.messages import GrammarSpec

#: the request fields read here (the schemas' refused tables leave them out)
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
TOOL_FIELDS = ("tools", "tool_choice")
#: a parameters schema for a function that declares none (OpenAI: no arguments)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Structured:
    """What the gateway sends and how it answers: ``grammar`` (None: unconstrained) and,
    for forced tool calls, ``tool_mode`` (``"required"`` or ``"named"``; "" otherwise) with
    ``tool_name`` (the named function)."""

    grammar: GrammarSpec | None = None
    tool_mode: str = ""
    tool_name: str = ""


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or its JSON text) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise bad_request(f"{param} is not valid JSON: {err}", param=param) from err
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema, ensure_ascii=False)  # key order kept: it is the output order


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request('response_format must be an object with a "type"',
                          param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}')
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request('response_format json_schema needs "json_schema": {"name", '
                              '"schema"}', param="response_format")
        schema = js.get("schema", {})
        return GrammarSpec(kind="json_schema",
                           value=_schema_text(schema, "response_format.json_schema.schema"))
    raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, "
                      "json_schema)", param="response_format")


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or \
            not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param=param)
    return GrammarSpec(kind="lark", value=lark_choice(value))


def _grammar(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{param} must be a grammar (Lark or GBNF text)", param=param)
    try:
        return GrammarSpec(kind="lark", value=gbnf_to_lark(value))
    except ValueError as err:
        raise bad_request(f"{param}: {err}", param=param) from err


def _regex(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a regular expression string", param=param)
    return GrammarSpec(kind="regex", value=value)


def _structured_outputs(value: Any) -> GrammarSpec | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param=param)
    known = {"json", "regex", "choice", "grammar", "json_object"}
    unknown = sorted(k for k, v in value.items() if v is not None and k not in known
                     and k not in ("disable_fallback", "disable_any_whitespace",
                                   "disable_additional_properties", "whitespace_pattern"))
    if unknown:
        raise bad_request(f"{param} fields {unknown} are not supported", param=param)
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object") is True:
        given.append("json_object")
    if len(given) != 1:
        raise bad_request(f"{param} needs exactly one of json, regex, choice, grammar, "
                          f"json_object (got {given or 'none'})", param=param)
    key = given[0]
    if key == "json":
        return GrammarSpec(kind="json_schema", value=_schema_text(value["json"], param))
    if key == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}')
    if key == "regex":
        return _regex(value["regex"], param)
    if key == "choice":
        return _choice(value["choice"], param)
    return _grammar(value["grammar"], param)


def _tools(tools: Any) -> dict[str, dict]:
    """name -> parameters schema of ``tools`` (OpenAI function tools)."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list", param="tools")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": '
                              '{"name": ..., "parameters": ...}}', param="tools")
        params = fn.get("parameters")
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              param="tools")
        out[fn["name"]] = params
    return out


def required_tools_schema(tools: dict[str, dict], parallel: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"`` (vLLM's): an array of one or more calls
    (exactly one when not ``parallel``: OpenAI's ``parallel_tool_calls: false``),
    each ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` and nothing
    else (vLLM's schema allows other keys, which a call has no use for)."""
    calls = [{"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in tools.items()]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _tool_choice(tools: dict[str, dict] | None, choice: Any, template: str | None,
                 parallel: bool = True) -> Structured:
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return Structured()
    if tools is None:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        why = ("its chat template does not define tool calling" if "tools" not in
               (template or "") else "this server has no tool-call parser for its format")
        raise bad_request(f'tool_choice "auto" cannot be served for this model: {why}; use '
                          'tool_choice "required", a named function, or "none"',
                          param="tool_choice")
    if choice == "required":
        schema = required_tools_schema(tools, parallel)
        return Structured(GrammarSpec(kind="json_schema", value=json.dumps(schema)), "required")
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', param="tool_choice")
    name = fn["name"]
    if name not in tools:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                          param="tool_choice")
    return Structured(GrammarSpec(kind="json_schema", value=json.dumps(tools[name])),
                      "named", name)


def read_structured(fields: dict[str, Any], compiler: GrammarCompiler | None,
                    chat_template: str | None = None) -> Structured:
    """The request's constraint from its ``fields`` (the body's, by name; absent or null:
    not given), compiled with ``compiler`` (the gateway's tokenizer).

    Raises:
        GatewayError: 400 naming the field for a malformed value, two constraints at once,
            ``tool_choice: "auto"`` (see the module docstring) or a spec that does not
            compile (the compiler's message: a bad schema, regex or grammar).
    """
    found: list[tuple[str, GrammarSpec]] = []
    for name in STRUCTURED_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if name == "response_format":
            spec = _response_format(value)
        elif name == "structured_outputs":
            spec = _structured_outputs(value)
        elif name == "guided_json":
            spec = GrammarSpec(kind="json_schema", value=_schema_text(value, name))
        elif name == "guided_regex":
            spec = _regex(value, name)
        elif name == "guided_choice":
            spec = _choice(value, name)
        else:
            spec = _grammar(value, name)
        if spec is not None:
            found.append((name, spec))
    tools = None if fields.get("tools") in (None, []) else _tools(fields["tools"])
    out = _tool_choice(tools, fields.get("tool_choice"), chat_template,
                       fields.get("parallel_tool_calls") is not False)
    if out.grammar is not None:
        found.append(("tool_choice", out.grammar))
    if len(found) > 1:
        raise bad_request(f"only one output constraint per request (got "
                          f"{', '.join(n for n, _ in found)})", param=found[1][0])
    if not found:
        return out
    name, spec = found[0]
    if compiler is None:
        raise bad_request(f"{name} is not supported by this server (no grammar compiler)",
                          param=name)
    why = compiler.check(spec)
    if why:
        raise bad_request(f"{name}: the constraint does not compile: {why.strip()}",
                          param=name)
    return Structured(spec, out.tool_mode, out.tool_name)


def tool_calls(structured: Structured, text: str) -> list[dict] | None:
    """The ``tool_calls`` of a finished forced-tool output ``text`` (OpenAI's shape, arguments
    as JSON text), or None when the text does not parse as the grammar's JSON (an output cut
    by ``max_tokens`` or a stop string: it is answered as plain content)."""
    if not structured.tool_mode:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if structured.tool_mode == "named":
        calls = [(structured.tool_name, value)]
    elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
        calls = [(c["name"], c.get("parameters", {})) for c in value]
    else:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]


def forced_tool_calls(structured: Structured | None, text: str, reason: str) -> list | None:
    """The tool calls of a forced-tool output that ended by its grammar (finish reason
    ``stop``), None otherwise (no tools forced, or an output cut short: plain content)."""
    if structured is None or not structured.tool_mode or reason != "stop":
        return None
    return tool_calls(structured, text)
