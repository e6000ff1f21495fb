"""policies package of chunkgym."""

__chunkgym__ = True
