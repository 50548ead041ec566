"""An OpenAI-compatible server for a trained model: ``python -m ernie_moe.serve --model DIR [--host 127.0.0.1]
[--port 8000]``.

``POST /v1/chat/completions`` takes the API's chat requests (``messages`` with text and ``image_url`` parts: a
``data:image/...;base64,`` URL, or a local path under ``--image-root``; ``stream``, ``temperature``, ``top_p``,
``max_tokens``, ``stop``, ``seed``) and answers whole or as server-sent events; ``GET /v1/models`` names the one
model this process serves (``--served-name``, else the folder's name); ``/`` is a chat page. Images are encoded
as the folder's training encoded them; the requests waiting while the model answers are answered together in its
next turn (``--batch-size`` at a time), the others queue (``--max-queue``). Any OpenAI client works:
``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")``. Ctrl-C or ``kill`` (SIGTERM) stops it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .checkpoint.errors import CheckpointError
from .cli import MAX_MB, add_speculative_argument, add_thinking_argument, at_least_one, bounded, thinking_of
from .config import ConfigError
from .serving.chat_model import SIDE_BY_SIDE, ChatModel
from .serving.openai_api import Limits
from .serving.server import ChatServer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="final model, checkpoint, PaddleFormers folder or adapter")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: any free port")
    parser.add_argument("--served-name", help="the model name clients send (default: the folder's name)")
    parser.add_argument("--image-root", help="a folder local image paths are read from (default: none are read)")
    parser.add_argument("--config", help="a training config whose data section overrides the folder's settings")
    parser.add_argument("--max-request-mb", type=bounded(float, 0, MAX_MB, low_included=False), default=20.0)
    parser.add_argument("--max-images", type=bounded(int, 0), default=Limits.max_images, help="per request")
    parser.add_argument("--max-tokens", type=at_least_one, default=Limits.max_tokens,
                        help="the most new tokens a request may ask for, and the default")
    parser.add_argument("--max-queue", type=bounded(int, 0), default=Limits.max_queue,
                        help="requests held beyond one (being answered or waiting for the model's next turn); "
                             "more get 503")
    parser.add_argument("--batch-size", type=at_least_one, default=SIDE_BY_SIDE,
                        help="requests the model answers side by side in one turn, at most")
    parser.add_argument("--weight-updates", help="a folder a trainer writes new weights into: the weight-update "
                                                 "routes read folders of safetensors under it (default: off)")
    add_thinking_argument(parser)
    add_speculative_argument(parser)
    args = parser.parse_args(argv)
    folders = {}
    for flag, given in (("--image-root", args.image_root), ("--weight-updates", args.weight_updates)):
        folders[flag] = Path(given).resolve() if given else None
        if given and not Path(given).is_dir():
            print(f"serve error: {flag} '{given}' is not a folder", file=sys.stderr)
            return 2
    image_root = folders["--image-root"]
    try:
        chat = ChatModel(args.model, args.config, args.batch_size, draft_tokens=args.draft_tokens)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"serve error: {err}", file=sys.stderr)
        return 2
    limits = Limits(int(args.max_request_mb * 2 ** 20), args.max_images, args.max_tokens, args.max_queue)
    served = args.served_name or Path(args.model).resolve().name
    try:
        server = ChatServer((args.host, args.port), chat, served, limits, image_root, thinking=thinking_of(args),
                            weight_updates=folders["--weight-updates"])
    except OSError as err:
        print(f"serve error: cannot listen on {args.host}:{args.port}: {err.strerror}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    host = host.decode() if isinstance(host, bytes) else host
    # kill (SIGTERM) stops the server as Ctrl-C does; Paddle's own handler would print a C++ error block
    stopped: list[int] = []

    def stop(signum, frame) -> None:
        stopped.append(signum)
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"serving '{served}' on http://{host}:{port} (OpenAI API under /v1, chat page at /; Ctrl-C or kill "
          "stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        stopped.append(signal.SIGINT)
    finally:
        server.server_close()
    if stopped:
        print(f"stopped ({signal.Signals(stopped[0]).name})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
