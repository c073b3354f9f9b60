"""Tool calls for ``vericache serve``: OpenAI ``tools`` and ``tool_choice`` in the model family's own
tool-call format, its output parsed back into OpenAI ``tool_calls``.

A format is chosen by the model's chat template; a model whose template matches none has no tool
calls here (a 400 that says so). SmolLM2's format (its model card's function calling): a system
prompt listing the tools in ``<tools>...</tools>``, the calls answered as a JSON list in
``<tool_call>...</tool_call>``. ``tool_choice: "required"`` or a named function constrains the
answer with the grammar of that list (the named tool's, or any tool's, parameters as JSON schemas),
so drafting and verification follow it as any structured output does (``engine/constraint.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    """Tools this server cannot serve for this request or model (a 400)."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


class SmolLM2Tools:
    """SmolLM2's tool calling (its model card): tools in the system prompt, calls as a JSON list."""

    name = "smollm2"
    INSTRUCTIONS = (
        "You are an expert in composing functions. You are given a question and a set of possible functions. Based "
        "on the question, you will need to make one or more function/tool calls to achieve the purpose. If none of "
        "the functions can be used, point it out and refuse to answer. If the given question lacks the parameters "
        "required by the function, also point it out.\n\nYou have access to the following tools:\n<tools>{tools}"
        "</tools>\n\nThe output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
        "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
        'needed, please make the tool calls an empty list \'[]\'.\n<tool_call>[\n{{"name": "func_name1", '
        '"arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n... (more tool calls as '
        "required)\n]</tool_call>"
    )

    @staticmethod
    def matches(chat_template: str | None) -> bool:
        return bool(chat_template) and "You are a helpful AI assistant named SmolLM" in chat_template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages the chat template takes: the tools in the system prompt, earlier calls as the
        model writes them, tool results as ``tool`` turns."""
        system = self.INSTRUCTIONS.format(tools=json.dumps([t["function"] for t in tools]))
        out = [{"role": "system", "content": system}]
        for m in messages:
            if m["role"] == "system":
                out[0]["content"] = f"{m['content']}\n\n{system}"
            elif m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                    for c in m["tool_calls"]
                ]
                out.append({"role": "assistant", "content": f"{OPEN}{json.dumps(calls)}{CLOSE}"})
            else:
                out.append({"role": m["role"], "content": m.get("content") or ""})
        return out

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The calls in an answer and the text around them (None when there is none)."""
        calls: list[Call] = []
        rest = text
        for m in re.finditer(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, re.S):
            try:
                listed = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue  # not a call after all: stays text
            listed = listed if isinstance(listed, list) else [listed]
            calls += [
                Call(c["name"], c.get("arguments") or {})
                for c in listed
                if isinstance(c, dict) and isinstance(c.get("name"), str)
            ]
            rest = rest.replace(m.group(0), "")
        rest = rest.strip()
        return (rest or None) if calls else text, calls

    def grammar(self, tools: list[dict[str, Any]], name: str | None, single: bool = False) -> Any:
        """The grammar of a required answer: one or more calls (of ``name`` only, when given; one
        call only with ``single``)."""
        import xgrammar as xgr

        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        calls = {
            "type": "array",
            "minItems": 1,
            **({"maxItems": 1} if single else {}),
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": f["name"]},
                            "arguments": f.get("parameters") or {"type": "object"},
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for f in chosen
                ]
            },
        }
        literal = lambda text: xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
        return xgr.Grammar.concat(literal(OPEN), xgr.Grammar.from_json_schema(json.dumps(calls)), literal(CLOSE))


FORMATS = (SmolLM2Tools(),)


@dataclass(frozen=True)
class ToolPrompt:
    format: SmolLM2Tools
    messages: list[dict[str, Any]]  # the conversation in the format, for the chat template
    calls: bool  # whether the answer may hold calls (tool_choice is not "none")


def tool_format(chat_template: str | None) -> SmolLM2Tools:
    """The tool-call format of a model, by its chat template; ToolError when none is known."""
    for fmt in FORMATS:
        if fmt.matches(chat_template):
            return fmt
    raise ToolError(
        "this model's chat template has no tool-call format this server knows "
        f"(known: {', '.join(f.name for f in FORMATS)}); send the request without tools"
    )


def required_function(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None) -> tuple[bool, str | None]:
    """(whether a call is required, the one function it must be) from ``tool_choice``."""
    names = [t.get("function", {}).get("name") for t in tools]
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return True, name
    raise ToolError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def check_tools(tools: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}}}}}"
            )
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema object")
