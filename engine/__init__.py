"""engine package of chunkgym."""

__chunkgym__ = True
