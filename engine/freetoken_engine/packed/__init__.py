"""The pre-packed fast-start format: the expert bank's final host layout on disk.

``freetoken convert --model DIR --out DIR2`` calls ``convert(DIR, DIR2)``; an engine loading DIR2
calls ``load_packed(DIR2, dtype)`` (``is_packed(DIR2)`` tells the folders apart); ``preload(DIR2)``
starts the read before torch is imported (``early.py``). Layout of DIR2:

    freetoken-packed.json        the index (format, version, shapes, files, sizes, CRC32s)
    bank-w13-00000.bin ...       w13 [L_moe, E, 2I, H] split by MoE layers, raw, final layout
    bank-w2-00000.bin ...        w2  [L_moe, E, H, I]  the same
    dense-00000.bin ...          every non-expert tensor, 4 KiB-aligned, checkpoint key names
    config.json, tokenizer.json, ...   every other file of DIR, copied: the folder stands alone

Every tensor starts on a 4 KiB boundary and every file is padded to one, so a bank file is read
with O_DIRECT straight into the page-aligned bank (no page cache, no bounce copy).
"""
from .early import preload
from .format import INDEX_NAME, PackedFormatError, is_packed

__all__ = ["INDEX_NAME", "PackedFormatError", "PackedModel", "convert", "is_packed", "load_packed", "preload"]


def __getattr__(name: str):
    # Lazy: the reader and the writer import torch; ``preload`` and the index checks must not.
    if name in ("PackedModel", "load_packed"):
        from . import reader
        return getattr(reader, name)
    if name == "convert":
        from .writer import convert
        return convert
    raise AttributeError(name)
