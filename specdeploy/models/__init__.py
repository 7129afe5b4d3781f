"""Plain-PyTorch model definitions built from canonical ops (no caches, no serving logic)."""
