"""Stub model APIs on 127.0.0.1 for the real agent hosts' tests (test_tactmem.py, "host setup").

One HTTP server speaks the three APIs the hosts' CLIs call — Anthropic Messages (Claude Code,
through ANTHROPIC_BASE_URL), OpenAI Responses (Codex, through a model provider's base_url) and the
Gemini API (Gemini CLI, through GOOGLE_GEMINI_BASE_URL) — streaming as each host asks. It plays a
model that calls the memory tool: each turn makes the next queued call of the tool the host
declared (the first tool whose name ends in `memory`), and once every call has had its result,
ends the turn with a line of text. Which call is next is read off the request (how many tool
results it carries), so the extra requests a host makes (titles, token counts) change nothing.
Every request and every tool result the hosts sent back is kept, to be checked.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

DONE = "The memory tool answered."


class StubModels:
    """The stub server: `origin` is its base URL; `close()` stops it."""

    def __init__(self, calls: Sequence[dict[str, Any]]) -> None:
        self.calls = list(calls)
        self.requests: list[tuple[str, Any]] = []  # (path, body) of each POST
        self.results: list[str] = []  # the text of each tool result the hosts sent, in order
        self.lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    body = {"unparsed": raw.decode("utf-8", "replace")}
                with stub.lock:
                    stub.requests.append((self.path, body))
                status, kind, chunks = stub.answer(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                data = b"".join(chunks)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # model lists and the like: none here
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.origin = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # ---------------------------------------------------------------- dispatch

    def answer(self, path: str, body: Any) -> tuple[int, str, list[bytes]]:
        route = path.split("?")[0]
        if route.endswith("/messages/count_tokens"):
            return 200, "application/json", [_dumps({"input_tokens": 1})]
        if route.endswith("/messages"):
            return self._messages(body)
        if route.endswith("/responses"):
            return self._responses(body)
        if route.endswith(":countTokens"):
            return 200, "application/json", [_dumps({"totalTokens": 1})]
        if ":streamGenerateContent" in route or ":generateContent" in route:
            return self._gemini(body, stream=":streamGenerateContent" in route)
        return 404, "application/json", [_dumps({"error": {"message": f"no stub for {route}"}})]

    def _next(self, tool: str | None, results: list[str]) -> dict[str, Any] | None:
        """The next tool call to make, or None to end the turn; keeps the results seen."""
        with self.lock:
            for text in results[len(self.results) :]:
                self.results.append(text)
        if tool is None or len(results) >= len(self.calls):
            return None
        return self.calls[len(results)]

    # ---------------------------------------------------------------- Anthropic Messages

    def _messages(self, body: dict[str, Any]) -> tuple[int, str, list[bytes]]:
        tools = [tool.get("name", "") for tool in body.get("tools", [])]
        tool = next((name for name in tools if name.endswith("memory")), None)
        results = [
            _text_of(block.get("content"))
            for message in body.get("messages", [])
            if message.get("role") == "user" and isinstance(message.get("content"), list)
            for block in message["content"]
            if block.get("type") == "tool_result"
        ]
        call = self._next(tool, results)
        number = len(results) + 1
        if call is not None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": f"toolu_{number:04}",
                "name": tool,
                "input": {},
            }
            delta = {"type": "input_json_delta", "partial_json": json.dumps(call)}
            stop = "tool_use"
            whole = {**block, "input": call}
        else:
            block = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": DONE}
            stop = "end_turn"
            whole = {"type": "text", "text": DONE}
        message = {
            "id": f"msg_{number:04}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "stub"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        if not body.get("stream"):
            answer = {**message, "content": [whole], "stop_reason": stop}
            return 200, "application/json", [_dumps(answer)]
        events = [
            ("message_start", {"type": "message_start", "message": message}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            ),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 1},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        return 200, "text/event-stream", [_event(data, name) for name, data in events]

    # ---------------------------------------------------------------- OpenAI Responses

    def _responses(self, body: dict[str, Any]) -> tuple[int, str, list[bytes]]:
        found = [
            (space, name)
            for space, name in _response_tools(body.get("tools", []))
            if name.endswith("memory")
        ]
        space, tool = found[0] if found else (None, None)
        items = body.get("input", [])
        results = [
            _text_of(item.get("output"))
            for item in items
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        ]
        call = self._next(tool, results)
        number = len(results) + 1
        if call is not None:
            item: dict[str, Any] = {
                "type": "function_call",
                "id": f"fc_{number:04}",
                "call_id": f"call_{number:04}",
                "name": tool,
                "arguments": json.dumps(call),
                "status": "completed",
                **({"namespace": space} if space else {}),  # Codex: MCP tools by server
            }
        else:
            item = {
                "type": "message",
                "id": f"msg_{number:04}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": DONE, "annotations": []}],
            }
        response = {
            "id": f"resp_{number:04}",
            "object": "response",
            "status": "completed",
            "model": body.get("model", "stub"),
            "output": [item],
            "usage": {
                "input_tokens": 1,
                "output_tokens": 1,
                "total_tokens": 2,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
        events: list[dict[str, Any]] = [
            {
                "type": "response.created",
                "response": {**response, "status": "in_progress", "output": []},
            },
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": response},
        ]
        return 200, "text/event-stream", [_event(event, event["type"]) for event in events]

    # ---------------------------------------------------------------- Gemini API

    def _gemini(self, body: dict[str, Any], *, stream: bool) -> tuple[int, str, list[bytes]]:
        declared = [
            declaration.get("name", "")
            for tools in body.get("tools", [])
            for declaration in tools.get("functionDeclarations", [])
        ]
        tool = next((name for name in declared if name.endswith("memory")), None)
        results = [
            _text_of(part["functionResponse"].get("response"))
            for content in body.get("contents", [])
            for part in content.get("parts", [])
            if "functionResponse" in part
        ]
        call = self._next(tool, results)
        part: dict[str, Any] = (
            {"text": DONE} if call is None else {"functionCall": {"name": tool, "args": call}}
        )
        answer = {
            "candidates": [
                {"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}
            ],
            "usageMetadata": {
                "promptTokenCount": 1,
                "candidatesTokenCount": 1,
                "totalTokenCount": 2,
            },
            "modelVersion": "stub",
        }
        if not stream:
            return 200, "application/json", [_dumps(answer)]
        return 200, "text/event-stream", [_event(answer)]


def _response_tools(tools: list[Any], space: str | None = None) -> Iterator[tuple[str | None, str]]:
    """The functions a Responses request declares, each with its namespace (or None)."""
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            yield from _response_tools(tool.get("tools", []), tool.get("name"))
        elif isinstance(tool, dict) and "name" in tool:
            yield space, tool["name"]


def _text_of(content: Any) -> str:
    """A tool result as text: a string, content blocks' texts, or any other JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            _text_of(block.get("text", block)) if isinstance(block, dict) else _text_of(block)
            for block in content
        )
    return json.dumps(content)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _event(data: Any, name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()
