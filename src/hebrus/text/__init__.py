"""Text at the edge: a model's tokenizer and chat template (`tokenizers`, `templates`), and
generation from text with the defaults every text-level entry point shares (`generation`). The
engine below speaks token ids only; `entry` (`hebrus.generate`, which loads models by name) sits
above the runtime and is not imported here, so a session can use this package."""
from hebrus.text.generation import (DEVICE, DTYPE, MAX_NEW_TOKENS, MODE, MODEL, SAMPLING, Conversation, TextOptions,
                                  TextStream, stream_text, summary)
from hebrus.text.tokenizers import ByteTokenizer, CheckpointTokenizer, tokenizer_for

__all__ = ["DEVICE", "DTYPE", "MAX_NEW_TOKENS", "MODE", "MODEL", "SAMPLING", "ByteTokenizer", "CheckpointTokenizer",
           "Conversation", "TextOptions", "TextStream", "stream_text", "summary", "tokenizer_for"]
