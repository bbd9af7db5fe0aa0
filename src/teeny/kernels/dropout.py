"""dropout ops (being written)."""

__all__: list[str] = []
NN_LAYERS: list[str] = []
