"""What records look like where they are kept, read into samples: JSONL captions and conversations, ERNIEKit's
SFT records, preference pairs, the synthetic shapes, shard formats and video files."""
