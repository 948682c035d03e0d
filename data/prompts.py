"""The bench's inputs: a user's prompts file (JSONL) or the bundled workload set, the
``--concurrency`` list, and the requests one concurrency level sends. Pure functions, no torch,
no Ray.

The workload set (``workloads.jsonl``, ``--prompts workloads``) holds prompts by the kind of
work a drafter meets: everyday ``chat``; ``code-edit``, a snippet with an instruction that
changes a few lines, whose ``prediction`` is the original code (OpenAI's Predicted Outputs);
``extraction``, a passage and a question whose answer copies from it; ``multi-turn``,
conversations whose last turn asks to repeat, revise or extend an earlier answer."""

from __future__ import annotations

import json
from importlib import resources

#: Roles a chat message may have in a prompts file.
MESSAGE_ROLES = ("system", "user", "assistant")
#: ``--prompts`` names of the bundled workload set (instead of a file).
WORKLOADS = "workloads"
#: Categories of the bundled workload set, in the order its tables list them.
WORKLOAD_CATEGORIES = ("chat", "code-edit", "extraction", "multi-turn")


def parse_concurrency(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (order kept, duplicates dropped).

    Raises:
        SystemExit: an empty list, a non-integer or a level below 1.
    """
    levels: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            level = int(part)
        except ValueError:
            raise SystemExit(f"--concurrency: {part!r} is not an integer (e.g. 1,4,16)") from None
        if level < 1:
            raise SystemExit(f"--concurrency: levels must be >= 1, got {level}")
        if level not in levels:
            levels.append(level)
    if not levels:
        raise SystemExit("--concurrency: no level given")
    return levels


def _messages(obj: dict, where: str) -> list[dict]:
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise SystemExit(f"{where}: \"messages\" must be a non-empty list")
        for m in msgs:
            if (not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES
                    or not isinstance(m.get("content"), str)):
                raise SystemExit(f"{where}: every message needs a \"role\" "
                                 f"({'/'.join(MESSAGE_ROLES)}) and a string \"content\"")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}]
    raise SystemExit(f"{where}: needs \"messages\" (a list) or \"prompt\" (a string)")


def _prediction(obj: dict, where: str) -> dict:
    """``{"prediction": text}`` when the line has one, else ``{}``."""
    if obj.get("prediction") is None:
        return {}
    if not isinstance(obj["prediction"], str) or not obj["prediction"]:
        raise SystemExit(f"{where}: \"prediction\" must be a non-empty string (the text "
                         f"expected in the answer)")
    return {"prediction": obj["prediction"]}


def parse_prompts_jsonl(text: str, source: str = "<prompts>") -> list[dict]:
    """Prompts from JSONL text: one JSON object per line, either ``{"messages": [...]}`` or
    ``{"prompt": "..."}`` (a single user message), optional ``"name"``, ``"category"`` and
    ``"prediction"`` (text expected to reappear in the answer, sent as OpenAI's Predicted
    Outputs ``prediction``). Blank lines and lines starting with ``#`` are skipped. Returns
    ``[{name, category, messages}]`` like the bundled prompts, with ``prediction`` on the
    prompts that have one.

    Raises:
        SystemExit: a malformed line (the message names ``source`` and the line number) or a
            file without prompts.
    """
    prompts: list[dict] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise SystemExit(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompts.append({"name": str(obj.get("name") or f"prompt-{len(prompts) + 1}"),
                        "category": str(obj.get("category") or "user"),
                        "messages": _messages(obj, where), **_prediction(obj, where)})
    if not prompts:
        raise SystemExit(f"{source}: no prompts")
    return prompts


def load_prompts_file(path: str) -> list[dict]:
    """:func:`parse_prompts_jsonl` over the file at ``path``.

    Raises:
        SystemExit: the file cannot be read, or a malformed line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise SystemExit(f"--prompts: cannot read {path}: {err.strerror}") from None
    return parse_prompts_jsonl(text, path)


def load_workloads() -> list[dict]:
    """The bundled workload set (``workloads.jsonl``): :data:`WORKLOAD_CATEGORIES`, about six
    prompts each, predictions on the ``code-edit`` ones."""
    text = resources.files("specmesh.data").joinpath("workloads.jsonl").read_text("utf-8")
    return parse_prompts_jsonl(text, "workloads.jsonl")


def load_prompt_set(spec: str) -> list[dict]:
    """``--prompts``: the bundled workload set when ``spec`` is :data:`WORKLOADS`, else the
    JSONL file at ``spec`` (a file named ``workloads`` is ``./workloads``).

    Raises:
        SystemExit: the file cannot be read, or a malformed line.
    """
    return load_workloads() if spec == WORKLOADS else load_prompts_file(spec)


def level_requests(prompts: list[dict], concurrency: int) -> list[dict]:
    """The requests of one concurrency level: the prompts, cycled until every one of the
    ``concurrency`` clients has at least one (``max(len(prompts), concurrency)`` requests)."""
    n = max(len(prompts), concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]
