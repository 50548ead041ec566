"""Talk to a trained model in the terminal: ``python -m ernie_moe.chat --model DIR``.

Each line is a user turn; the answer streams in as it is generated and the conversation is kept in the model's
chat format. Commands: ``/image PATH`` attaches an image to the next turn, ``/video FRAME...`` a video as its
frame files (or one video file), ``/reset`` starts over, ``/save FILE.jsonl`` appends the conversation to FILE
as a training record (its images by path, relative to FILE's folder), ``/quit`` (or end of input) leaves.
Images are encoded as the folder's training encoded them; decoding is greedy unless ``--temperature`` is above 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .checkpoint.errors import CheckpointError
from .cli import add_decoding_arguments, thinking_of
from .config import ConfigError
from .data.encoding.packing import BadSample
from .data.formats.jsonl import IMAGE_MARK, VIDEO_MARK, load_image, load_video, local, parse_messages
from .generation import UsageError
from .paths import not_a_file, open_output
from .serving.chat_model import ChatModel, Sampling

HELP = "/image PATH, /video FRAME... (or a video file), /reset, /save FILE.jsonl, /quit"


class Transcript:
    """The turns so far in the training JSONL's shape: string contents with ``<image>`` / ``<video>`` markers,
    the files in ``images`` and ``videos``."""

    def __init__(self):
        self.messages: list[dict] = []
        self.images: list[str] = []
        self.videos: list = []
        self.pending_images: list[str] = []
        self.pending_videos: list = []

    def user_turn(self, text: str) -> dict:
        marks = IMAGE_MARK * len(self.pending_images) + VIDEO_MARK * len(self.pending_videos)
        return {"role": "user", "content": marks + text}

    def record(self, folder: Path) -> dict:
        def relative(path: str) -> str:
            return os.path.relpath(path, folder)

        return {"images": [relative(p) for p in self.images],
                **({"videos": [relative(v) if isinstance(v, str) else [relative(f) for f in v]
                                for v in self.videos]} if self.videos else {}),
                "messages": self.messages}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="final model, checkpoint, PaddleFormers folder or adapter")
    parser.add_argument("--system", help="a system turn to start every conversation with")
    add_decoding_arguments(parser, max_new_tokens=256)
    args = parser.parse_args(argv)
    try:
        chat = ChatModel(args.model, args.config, draft_tokens=args.draft_tokens)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"chat error: {err}", file=sys.stderr)
        return 2
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    print(f"chatting with {args.model} ({HELP})", flush=True)
    talk = Transcript()
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        command, _, rest = line.partition(" ")
        if command == "/quit":
            return 0
        if command == "/reset":
            talk = Transcript()
            print("(a new conversation)")
        elif command == "/image":
            _attach(chat, talk, rest.strip(), video=False)
        elif command == "/video":
            _attach(chat, talk, rest.strip(), video=True)
        elif command == "/save":
            _save(talk, rest.strip())
        elif command.startswith("/"):
            print(f"unknown command {command}: {HELP}")
        else:
            _answer(chat, talk, line, sampling, args.system, thinking_of(args))


def _attach(chat: ChatModel, talk: Transcript, paths: str, video: bool) -> None:
    files = paths.split()
    if not files:
        print(f"/{'video' if video else 'image'} needs a path")
        return
    try:  # read now, so that a bad file is reported before the turn that would carry it
        if video:
            load_video(Path.cwd(), files if len(files) > 1 else files[0], chat.data.max_image_pixels,
                       chat.data.video_reading)
            talk.pending_videos.append([str(Path(f).resolve()) for f in files] if len(files) > 1
                                       else str(Path(files[0]).resolve()))
        else:
            for f in files:
                load_image(local(Path(), f, "image"), chat.data.max_image_pixels)
            talk.pending_images += [str(Path(f).resolve()) for f in files]
    except (BadSample, OSError) as err:
        print(f"not attached: {err}")
        return
    print(f"(attached to your next message: {', '.join(files)})")


def _answer(chat: ChatModel, talk: Transcript, text: str, sampling: Sampling, system: str | None,
            thinking: bool | None) -> None:
    turn = talk.user_turn(text)
    images, videos = talk.images + talk.pending_images, talk.videos + talk.pending_videos
    messages = ([{"role": "system", "content": system}] if system and not talk.messages else []) + talk.messages
    try:
        conversation, image_paths, video_sources = parse_messages([*messages, turn], images, videos)
        conversation.enable_thinking = thinking
        prompt = chat.encode(conversation, [load_image(Path(p), chat.data.max_image_pixels) for p in image_paths],
                             [load_video(Path("/"), v, chat.data.max_image_pixels, chat.data.video_reading)
                              for v in video_sources])
    except (BadSample, UsageError, OSError) as err:
        print(f"not sent: {err}")
        return
    print("model> ", end="", flush=True)
    reply = chat.reply(prompt, sampling, on_text=lambda piece: print(piece, end="", flush=True))
    print("\n(cut at --max-new-tokens)" if reply.finish_reason == "length" else "", flush=True)
    talk.messages = [*messages, turn, {"role": "assistant", "content": reply.text}]
    talk.images, talk.videos = images, videos
    talk.pending_images, talk.pending_videos = [], []


def _save(talk: Transcript, file: str) -> None:
    if not file:
        print("/save needs a file name")
        return
    if not talk.messages:
        print("nothing to save yet")
        return
    path = Path(file).resolve()
    problem = not_a_file(path) if path.exists() else None
    if problem is not None:  # a FIFO would block the write until something reads it
        print(f"not saved: '{path}' {problem}")
        return
    try:
        with open_output(path, "a") as out:
            out.write(json.dumps(talk.record(path.parent), ensure_ascii=False) + "\n")
    except OSError as err:
        print(f"not saved: {err.strerror}")
        return
    print(f"(saved {len(talk.messages)} messages to {path})")


if __name__ == "__main__":
    sys.exit(main())
