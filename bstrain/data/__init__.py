"""bstrain.data: byte-level corpora, splits and contiguous BPTT batches (see README)."""
from __future__ import annotations

from bstrain.data.text import (
    DEFAULT_CORPUS_BYTES, BpttBatches, ByteCorpus, DataError, bits_per_byte, check_size, default_corpus, load_bytes,
)

__all__ = [
    "DataError", "DEFAULT_CORPUS_BYTES", "default_corpus", "load_bytes", "check_size", "BpttBatches",
    "ByteCorpus", "bits_per_byte",
]
