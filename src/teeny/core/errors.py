"""teeny's own errors: each names what was wrong (op, node, kernel, argument)."""


class TeenyError(Exception):
    """Base of teeny's own errors."""


class PackingError(TeenyError):
    """Packed arguments do not match the kernel's signature."""


class GridError(TeenyError):
    """A launch grid is empty although there is work to do."""


class MissingBackwardError(TeenyError):
    """An op that gradients must flow through has no backward."""


class NoGradientError(TeenyError):
    """A training lowering whose loss depends on nothing that requires a gradient."""


class KernelLaunchError(TeenyError):
    """A kernel failed to compile or launch (the message names op, node, dtype and shapes)."""
