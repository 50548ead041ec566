"""The HTTP side of ``python -m ernie_moe.serve``: ``POST /v1/chat/completions`` (whole or streamed as server-sent
events), ``GET /v1/models``, the chat page at ``/``, and what a trainer drives it with as a rollout engine (vLLM's
routes: ``/pause``, ``/resume``, ``/is_paused`` and the four phases of a weight update). Each connection has a
thread; the requests that wait for the model are answered together in its next turn (``ChatModel.reply``); at most
``Limits.max_queue`` + 1 are held at once, more get 503. Every failure is answered in the API's error shape; none
stops the server."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs

from ..data.encoding.packing import BadSample
from ..generation import ContextTooLong, UsageError
from .chat_model import ChatModel
from .openai_api import ApiError, Completion, Limits, models_list, parse_request
from .weight_updates import WeightUpdates

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's; abort is its default

PAGE = resources.files(__package__).joinpath("page.html").read_bytes()


MAX_NESTING = 32  # a chat request's JSON is a few levels deep (messages, a message, its parts, an image_url)


def nesting(value) -> int:
    """How deep lists and objects nest in a JSON value (iteratively: a value nested 100,000 deep is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                return depth
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True  # a client that hangs up mid-answer does not keep the process alive
    # connections the kernel holds before they are accepted: socketserver's 5 reset some of the 32 an evaluation
    # harness opens at once (lmms-eval's default num_concurrent)
    request_queue_size = 1024

    def __init__(self, address, chat: ChatModel, served: str, limits: Limits, image_root: Path | None,
                 log_requests: bool = True, thinking: bool | None = None, weight_updates: Path | None = None):
        """``thinking``: ``enable_thinking`` for requests that do not set it (``chat_template_kwargs``);
        ``weight_updates``: the folder new weights are read from (None: weight updates are off)."""
        super().__init__(address, Handler)
        self.updates = WeightUpdates(chat.model, weight_updates)
        self.chat, self.served, self.limits, self.image_root = chat, served, limits, image_root
        self.thinking = thinking
        self.log_requests = log_requests
        self.created = int(time.time())
        self.waiting = 0  # requests holding or waiting for the model
        self.count_lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        """A client that hung up before its answer (or its error) was written: one quiet line, no traceback."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            if self.log_requests:
                print(f"{client_address[0]} hung up before its answer was written", file=sys.stderr, flush=True)
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    server: ChatServer
    server_version = "ernie_moe"
    timeout = 120  # seconds a client may leave its socket silent (a body that never comes, an unread stream)

    def log_message(self, format, *args):  # one line per request on stderr, as http.server does
        if self.server.log_requests:
            super().log_message(format, *args)

    def do_GET(self):
        if self.path in ("/", "/index.html"):
            self._send(200, PAGE, "text/html; charset=utf-8")
        elif self.path == "/v1/models":
            self._json(200, models_list(self.server.served, self.server.created))
        elif self.path == "/is_paused":
            chat = self.server.chat
            self._json(200, {"is_paused": chat.paused is not None, "waiting": chat.waiting(),
                             "policy_version": chat.policy_version})
        else:
            self._error(ApiError(404, f"no route GET {self.path[:200]}", code="not_found"))

    def do_POST(self):
        self.streaming = False  # once the stream's headers are out, an error can only end the connection
        route, _, query = self.path.partition("?")
        control = {"/pause": self._pause, "/resume": self._resume, "/init_weight_transfer_engine": self._init,
                   "/start_weight_update": self._start, "/update_weights": self._update,
                   "/finish_weight_update": self._finish}
        if route != "/v1/chat/completions" and route not in control:
            self._error(ApiError(404, f"no route POST {self.path[:200]}", code="not_found"))
            return
        try:
            if route in control:
                self._json(200, control[route](query))
            else:
                self._chat()
        except ApiError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client went away or went silent: nothing to answer
        except Exception:  # a bug must not take the server down: answer 500 (if nothing was sent yet), log it
            traceback.print_exc()
            if not self.streaming:
                self._error(ApiError(500, "the server failed on this request (see its log)", kind="server_error"))
            self.close_connection = True

    def _chat(self):
        s = self.server
        body = self._read_body()
        request = parse_request(body, s.served, s.limits, s.image_root, s.chat.data.max_image_pixels, s.thinking)
        try:
            prompt = s.chat.encode(request.conversation, request.images)
        except ContextTooLong as err:
            raise ApiError(400, str(err), "messages", "context_length_exceeded") from None
        except (UsageError, BadSample) as err:
            raise ApiError(400, str(err), "messages") from None
        with s.count_lock:
            if s.waiting >= s.limits.max_queue + 1:
                raise ApiError(503, f"{s.waiting} requests are in the queue; try again", kind="server_error",
                               code="queue_full")
            s.waiting += 1
        try:
            completion = Completion(request.model, s.chat.expert_pools())
            if request.stream:
                self._stream(completion, prompt, request)
            else:
                self._json(200, completion.whole(s.chat.reply(prompt, request.sampling), request.return_token_ids))
        finally:
            with s.count_lock:
                s.waiting -= 1

    def _pause(self, query: str) -> dict:
        mode = parse_qs(query).get("mode", ["abort"])[-1]
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode[:50]!r}", "mode")
        self.server.chat.pause(mode)
        return {"is_paused": True, "mode": mode}

    def _resume(self, query: str) -> dict:
        self.server.chat.resume()
        return {"is_paused": False}

    def _init(self, query: str) -> dict:
        return self.server.updates.init(self._control_body())

    def _start(self, query: str) -> dict:
        self._control_body()
        return self.server.updates.start()

    def _update(self, query: str) -> dict:
        return self.server.updates.update(self._control_body())

    def _finish(self, query: str) -> dict:
        """Apply the staged weights: the model must be paused, so that no token is sampled while they change."""
        self._control_body()
        chat = self.server.chat
        with chat.turn:
            if chat.paused is None:
                raise ApiError(409, "pause the server first (POST /pause?mode=wait|keep|abort): the weights change "
                                    "while no token is sampled")
            changed = self.server.updates.finish()
            chat.policy_version += 1
        return {"policy_version": chat.policy_version, "tensors": changed}

    def _control_body(self) -> dict:
        """A control route's JSON object (an absent body: none)."""
        if self.headers.get("Content-Length") in (None, "0"):
            return {}
        body = self._read_body()
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _stream(self, completion: Completion, prompt, request) -> None:
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def event(data: dict | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            self.wfile.write(f"data: {text}\n\n".encode())
            self.wfile.flush()

        event(completion.chunk({"role": "assistant", "content": ""}))
        reply = self.server.chat.reply(prompt, request.sampling, on_text=lambda piece: event(
            completion.chunk({"content": piece})))
        event(completion.chunk({}, reply.finish_reason, reply))
        event("[DONE]")

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(411, "the request needs a Content-Length")
        if int(length) > self.server.limits.max_request_bytes:
            self.close_connection = True  # the body is not read
            raise ApiError(413, f"the request is {int(length)} bytes, over the server's limit of "
                                f"{self.server.limits.max_request_bytes} (--max-request-mb)", code="request_too_large")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not JSON: {err}") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deep") from None
        if nesting(body) > MAX_NESTING:
            raise ApiError(400, f"the request body is nested more than {MAX_NESTING} deep: no chat request is")
        return body

    def _error(self, err: ApiError) -> None:
        self._json(err.status, err.body())

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
