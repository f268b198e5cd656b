"""Real training data: token files, their preparation, the step sampler and batch sources.

- :class:`TokenFile`: a flat binary of token ids (nanoGPT ``train.bin``) as windows of
  ``seq_len`` next-token pairs;
- :func:`prepare`: text files -> ``train.bin``, ``val.bin``, ``meta.json`` (bytes or a local
  Hugging Face tokenizer);
- :class:`EpochSampler`: step ``t`` -> the item indices of its global batch, a pure function
  of ``(seed, t, G, N)`` so resumed runs read what uninterrupted ones would;
- :class:`BatchSource` / :class:`EvalBatches`: the global batches a rank trains and
  evaluates on, reading only the rows the rank needs;
- :class:`DocumentBatches`: variable-length documents (JSONL) padded to the longest in the
  batch, with :func:`masked_token_loss` that ignores the padding;
- :class:`DocumentFile`, :class:`PackedDocuments`, :class:`PaddedDocuments`: the documents of
  a token file (offsets beside it) packed to a length budget or padded per batch.
"""

from dapple.datasets.documents import (
    IGNORE_INDEX,
    DocumentBatches,
    masked_token_loss,
    pad_batch,
    read_documents,
)
from dapple.datasets.packing import (
    DocumentFile,
    PackedDocuments,
    PaddedDocuments,
    docs_path,
    open_documents,
    pack_rows,
)
from dapple.datasets.prepare import Prepared, prepare, val_path
from dapple.datasets.sampler import EpochSampler
from dapple.datasets.source import Batch, BatchSource, EvalBatches, read_rows
from dapple.datasets.token_file import DTYPES, META_NAME, TokenFile, read_meta

__all__ = [
    "DTYPES",
    "IGNORE_INDEX",
    "META_NAME",
    "Batch",
    "BatchSource",
    "DocumentBatches",
    "DocumentFile",
    "EpochSampler",
    "EvalBatches",
    "PackedDocuments",
    "PaddedDocuments",
    "Prepared",
    "TokenFile",
    "docs_path",
    "masked_token_loss",
    "open_documents",
    "pack_rows",
    "pad_batch",
    "prepare",
    "read_documents",
    "read_meta",
    "read_rows",
    "val_path",
]
