"""The functional shape ops (``teeny.ops.reshape``, ``getitem``, ``concat``, ...): each checks
its arguments as PyTorch does, with PyTorch's error messages naming the op and its input, and
adds one node (``ops.py``) to the graph."""

from __future__ import annotations

import builtins
import math

import torch

from ...core import config
from ...core.common import cdiv
from ...core.graph import Tensor, graph_of
from ...core.runtime import RuntimeOp
from ..cast import to
from .kernels import MAX_INDEXED
from .ops import ConcatOp, ExpandOp, GetItemOp, IndexOp, PermuteOp, StopGradientOp, ViewOp

_py_slice = builtins.slice  # `slice` is an op of this module


# ------------------------------------------------------------------------- argument checking


def _wrap_dim(dim, ndim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what}: dim must be an int, got {dim!r}")
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise IndexError(
            f"{what}: dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim})"
        )
    return dim % bound


def _int_list(values, what: str) -> tuple[int, ...]:
    if isinstance(values, int) and not isinstance(values, bool):
        return (values,)
    try:
        out = tuple(values)
    except TypeError:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {values!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise TypeError(f"{what} must be ints, got {values!r}")
    return out


def _sizes_arg(sizes, what: str) -> tuple[int, ...]:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    return _int_list(sizes, what)


def _apply(x, op: RuntimeOp, inputs=None):
    return graph_of(x).apply(op, [x] if inputs is None else inputs)


def _fail(x, name: str, message: str, kind=ValueError):
    """A trace-time error naming the op and its input (graph.apply names the node for
    errors found there; these are found in the argument checks before it)."""
    raise kind(f"{name} of {getattr(x, 'name', '?')!r} with shape {tuple(getattr(x, 'shape', ()))}: {message}")


def _infer_shape(x, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    numel = math.prod(x.shape)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1:
        _fail(x, name, f"only one dimension can be inferred, got shape {list(shape)}")
    if any(s < -1 for s in shape):
        _fail(x, name, f"invalid shape dimension in {list(shape)}")
    if unknown:
        known = math.prod(s for s in shape if s != -1)
        if known == 0:
            _fail(
                x,
                name,
                f"cannot reshape tensor of {numel} elements into shape {list(shape)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous",
            )
        if numel % known:
            _fail(x, name, f"shape {list(shape)} is invalid for input of size {numel}")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        _fail(x, name, f"shape {list(shape)} is invalid for input of size {numel}")
    return shape


# ------------------------------------------------------------------------------ functional ops


def reshape(x, shape):
    """x with another shape of the same number of elements; one size may be -1 (inferred).
    Always a view (teeny's values are contiguous)."""
    shape = _infer_shape(x, _int_list(shape, "reshape: shape"), "reshape")
    return _apply(x, ViewOp("reshape", shape))


def view(x, *shape):
    """Same as reshape (``view(x, 2, -1)`` or ``view(x, (2, -1))``)."""
    return reshape(x, _sizes_arg(shape, "view: shape"))


def flatten(x, start_dim: int = 0, end_dim: int = -1):
    """Merge dims start_dim..end_dim into one (a 0-d tensor becomes shape (1,))."""
    shape = tuple(x.shape)
    start, end = _wrap_dim(start_dim, len(shape), "flatten"), _wrap_dim(end_dim, len(shape), "flatten")
    if start > end:
        _fail(x, "flatten", f"start_dim cannot come after end_dim (start_dim={start_dim}, end_dim={end_dim})")
    if not shape:
        return _apply(x, ViewOp("flatten", (1,)))
    return _apply(x, ViewOp("flatten", shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :]))


def unflatten(x, dim: int, sizes):
    """Split dim into ``sizes`` (one may be -1)."""
    shape = tuple(x.shape)
    d = _wrap_dim(dim, len(shape), "unflatten")
    sizes = _int_list(sizes, "unflatten: sizes")
    if not sizes:
        _fail(x, "unflatten", "sizes must be non-empty")
    part = _infer_shape(_Shaped(shape[d], x), sizes, "unflatten")
    return _apply(x, ViewOp("unflatten", shape[:d] + part + shape[d + 1 :]))


class _Shaped:
    """A stand-in with only a name and a 1-d shape (for checking unflatten's sizes)."""

    def __init__(self, n: int, x):
        self.shape, self.name = (n,), getattr(x, "name", "?")


def squeeze(x, dim=None):
    """Remove size-1 dims: all of them (dim=None) or those listed in ``dim`` (an int or a
    tuple); a listed dim whose size is not 1 is left alone, as in PyTorch."""
    shape = tuple(x.shape)
    if dim is None:
        dims = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = {_wrap_dim(d, len(shape), "squeeze") for d in _int_list(dim, "squeeze: dim")}
        dims = {d for d in dims if d < len(shape) and shape[d] == 1}
    return _apply(x, ViewOp("squeeze", tuple(s for i, s in enumerate(shape) if i not in dims)))


def unsqueeze(x, dim: int):
    """Insert a size-1 dim at ``dim`` (in [-ndim-1, ndim])."""
    shape = tuple(x.shape)
    d = _wrap_dim(dim, len(shape) + 1, "unsqueeze")
    return _apply(x, ViewOp("unsqueeze", shape[:d] + (1,) + shape[d:]))


def permute(x, dims):
    """Reorder the dims of x: output dim i is input dim dims[i]."""
    ndim = len(x.shape)
    dims = _int_list(dims, "permute: dims")
    if len(dims) != ndim:
        _fail(
            x,
            "permute",
            f"number of dims don't match in permute: got {len(dims)} dims {list(dims)} for a {ndim}-d tensor",
        )
    wrapped = tuple(_wrap_dim(d, ndim, "permute") for d in dims)
    if len(set(wrapped)) != ndim:
        _fail(x, "permute", f"repeated dim in permute: {list(dims)}")
    return _apply(x, PermuteOp("permute", wrapped))


def transpose(x, dim0: int, dim1: int):
    """Swap two dims of x."""
    ndim = len(x.shape)
    d0, d1 = _wrap_dim(dim0, ndim, "transpose"), _wrap_dim(dim1, ndim, "transpose")
    dims = list(range(ndim))
    if ndim:
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return _apply(x, PermuteOp("transpose", tuple(dims)))


def _is_index(item) -> bool:
    """Whether ``item`` is an advanced index: a graph tensor, a torch tensor or a list of ints."""
    return isinstance(item, (Tensor, torch.Tensor, list)) or (isinstance(item, tuple) and bool(item))


def _normalise_index(x, index, allow_advanced: bool = False) -> tuple[tuple, list]:
    """``(basic, advanced)`` for ``x[index]``: ``basic`` has the Ellipsis expanded, ints wrapped
    and range-checked, slices made explicit (slice(start, stop, step), 0 <= start <= stop <=
    size) and a full slice where an advanced index goes; ``advanced`` lists (dim of x[basic],
    dim of x, the index) for each index tensor or list."""
    if not isinstance(index, tuple):
        index = (index,)
    shape = tuple(x.shape)
    for item in index:
        basic = item is None or item is Ellipsis or isinstance(item, (int, _py_slice))
        if isinstance(item, bool) or not (basic or (allow_advanced and _is_index(item))):
            kind = "tensor" if hasattr(item, "shape") else type(item).__name__
            supported = ", index tensors and lists of ints" if allow_advanced else ""
            _fail(
                x,
                "getitem",
                f"index {item!r} is not supported (a {kind}): teeny indexes with ints, slices, None, ...{supported}",
                TypeError,
            )
    if sum(item is Ellipsis for item in index) > 1:
        _fail(x, "getitem", "an index can only have a single ellipsis ('...')", IndexError)
    consumed = sum(1 for item in index if item is not None and item is not Ellipsis)
    if consumed > len(shape):
        _fail(x, "getitem", f"too many indices for tensor of dimension {len(shape)} (got {consumed})", IndexError)
    fill = [_py_slice(None)] * (len(shape) - consumed)
    expanded = []
    for item in index:
        expanded.extend(fill if item is Ellipsis else [item])
    if not any(item is Ellipsis for item in index):
        expanded.extend(fill)
    out, advanced, dim = [], [], 0
    for item in expanded:
        if item is None:
            out.append(None)
            continue
        size = shape[dim]
        if isinstance(item, int):
            if not -size <= item < size:
                _fail(x, "getitem", f"index {item} is out of bounds for dimension {dim} with size {size}", IndexError)
            out.append(item % size)
        elif isinstance(item, _py_slice):
            for v in (item.start, item.stop, item.step):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                    _fail(x, "getitem", f"slice bounds must be ints or None, got {item!r}", TypeError)
            if item.step is not None and item.step <= 0:
                _fail(x, "getitem", f"slice step must be positive, got {item.step} in dim {dim}")
            start, stop, step = item.indices(size)
            out.append(_py_slice(start, max(start, stop), step))
        else:
            advanced.append((sum(1 for o in out if not isinstance(o, int)), dim, item))
            out.append(_py_slice(0, size, 1))
        dim += 1
    return tuple(out), advanced


def _index_tensor(x, item, dim: int) -> Tensor:
    """The graph tensor of an advanced index: a graph tensor of integers as it is, a list of
    ints or an integer torch tensor as a constant (checked against the dim's size here)."""
    size = x.shape[dim]
    if isinstance(item, Tensor):
        if item.dtype not in (torch.int64, torch.int32):
            what = "a boolean mask (a data-dependent shape)" if item.dtype == torch.bool else f"a {item.dtype}"
            _fail(
                x, "getitem", f"index tensor {item.name!r} is {what}: index tensors must be int64 or int32", TypeError
            )
        return item
    try:
        values = torch.as_tensor(item)
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or not (
        values.dtype in (torch.int64, torch.int32) or (values.numel() == 0 and values.dim() == 1)
    ):
        _fail(x, "getitem", f"index {item!r} must be a list of ints (or an integer tensor)", TypeError)
    values = values.to(torch.int64)
    bad = values[(values < -size) | (values >= size)]
    if bad.numel():
        _fail(x, "getitem", f"index {int(bad[0])} is out of bounds for dimension {dim} with size {size}", IndexError)
    return graph_of(x).constant(values)


def getitem(x, index):
    """x[index] as PyTorch indexes: ints, slices (step > 0, negative and out-of-range bounds
    clamped), None and Ellipsis (basic indexing: a contiguous selection such as x[2:5] is a
    view, others copy), and advanced indexing with index tensors (int64 or int32 graph tensors)
    and lists of ints, in any position. Several indices broadcast together to a shape B; B
    replaces the indexed dims where they are adjacent, else it comes first (a 0-d index drops
    its dim like an int). Negative indices count from the end; an index out of range is an
    IndexError for lists (at trace time) and, under ``teeny.core.config.check_indices``, an error
    after the forward for tensors (with the check off it reads 0 and gets no gradient).
    The backward adds dy into the indexed places (repeated indices sum) with atomic adds, or,
    under ``teeny.core.config.deterministic``, bit-reproducibly by sorting."""
    basic, advanced = _normalise_index(x, index, allow_advanced=True)
    if not advanced:
        return _apply(x, GetItemOp("getitem", basic))
    if len(advanced) > MAX_INDEXED:
        _fail(x, "getitem", f"at most {MAX_INDEXED} index tensors or lists can be combined, got {len(advanced)}")
    tensors = [_index_tensor(x, item, dim) for _, dim, item in advanced]
    shaped = [bool(t.shape) for t in tensors]
    try:
        index_shape = tuple(torch.broadcast_shapes(*[t.shape for t in tensors]))
    except RuntimeError:
        listing = ", ".join(str(list(t.shape)) for t in tensors)
        message = f"shape mismatch: indexing tensors could not be broadcast together with shapes {listing}"
        _fail(x, "getitem", message, IndexError)
    n = math.prod(index_shape)
    flat = [reshape(t if tuple(t.shape) == index_shape else expand(t, *index_shape), (n,)) for t in tensors]
    stacked = flat[0] if len(flat) == 1 else concat(flat)
    op = IndexOp(
        basic,
        [p for p, _, _ in advanced],
        shaped,
        index_shape,
        [d for _, d, _ in advanced],
        deterministic=config.deterministic,
        check=config.check_indices,
    )
    return _apply(x, op, [x, stacked])


def slice(x, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    """x[..., start:end:step, ...] along ``dim`` (torch.ops.aten.slice)."""
    d = _wrap_dim(dim, len(x.shape), "slice")
    if not x.shape:
        _fail(x, "slice", "cannot slice a 0-d tensor", IndexError)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        _fail(x, "slice", f"slice step must be positive, got {step!r}")
    index = (_py_slice(None),) * d + (_py_slice(start, end, step),)
    return _apply(x, GetItemOp("slice", _normalise_index(x, index)[0]))


def narrow(x, dim: int, start: int, length: int):
    """x.narrow(dim, start, length): ``length`` elements of dim from ``start`` (negative
    start counts from the end)."""
    d = _wrap_dim(dim, len(x.shape), "narrow")
    size = x.shape[d] if x.shape else 1
    if not -size <= start <= size:
        _fail(x, "narrow", f"start ({start}) is out of range for dimension {d} of size {size}", IndexError)
    start = start % size if start < 0 else start
    if length < 0 or start + length > size:
        _fail(x, "narrow", f"start ({start}) + length ({length}) exceeds dimension size ({size})")
    return slice(x, d, start, start + length)


def _tensor_list(tensors, name: str) -> list:
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name}: expected a non-empty list of tensors")
    return list(tensors)


def _converted(t, dtype: torch.dtype):
    """``t`` in ``dtype`` (a copy converting each element, whose gradient converts back)."""
    return t if t.dtype == dtype else to(t, dtype)


def concat(tensors, dim: int = 0):
    """Join tensors along ``dim``; every other size must match. As in PyTorch, 1-d empty
    tensors (shape (0,)) are skipped, and tensors of different dtypes are promoted to a common
    one (bool < integers < floats, ``torch.promote_types``) by a converting copy."""
    tensors = _tensor_list(tensors, "concat")
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    kept = [t for t in tensors if tuple(t.shape) != (0,)] or tensors[:1]
    first = kept[0]
    ndim = len(first.shape)
    if ndim == 0:
        raise ValueError(f"concat: zero-dimensional tensor {first.name!r} cannot be concatenated")
    d = _wrap_dim(dim, ndim, "concat")
    for t in kept:
        if len(t.shape) != ndim:
            raise ValueError(
                f"concat: tensors must have the same number of dimensions: {first.name!r} has shape "
                f"{tuple(first.shape)} but {t.name!r} has shape {tuple(t.shape)}"
            )
        for k in range(ndim):
            if k != d and t.shape[k] != first.shape[k]:
                raise ValueError(
                    f"concat: sizes of tensors must match except in dimension {d}: expected size "
                    f"{first.shape[k]} but got size {t.shape[k]} in dimension {k} ({first.name!r} has "
                    f"shape {tuple(first.shape)}, {t.name!r} has shape {tuple(t.shape)})"
                )
    kept = [_converted(t, dtype) for t in kept]
    return graph_of(kept).apply(ConcatOp("concat", d, len(kept)), kept)


cat = concat


def stack(tensors, dim: int = 0):
    """Join same-shaped tensors along a new dim ``dim`` (dtypes promoted as in concat)."""
    tensors = _tensor_list(tensors, "stack")
    first = tensors[0]
    for t in tensors:
        if tuple(t.shape) != tuple(first.shape):
            raise ValueError(
                f"stack expects each tensor to be equal size, but got {tuple(first.shape)} for "
                f"{first.name!r} and {tuple(t.shape)} for {t.name!r}"
            )
    d = _wrap_dim(dim, len(first.shape) + 1, "stack")
    return concat([unsqueeze(t, d) for t in tensors], d)


def split(x, split_size_or_sections, dim: int = 0):
    """A list of consecutive parts of x along ``dim``: of size ``split_size_or_sections`` (the
    last one smaller) or of the listed sizes, which must add up to the dim's size."""
    if not x.shape:
        _fail(x, "split", "cannot split a 0-d tensor", ValueError)
    d = _wrap_dim(dim, len(x.shape), "split")
    size = x.shape[d]
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        step = split_size_or_sections
        if step < 0:
            _fail(x, "split", f"split expects split_size be non-negative, but got split_size={step}")
        if step == 0 and size > 0:
            _fail(x, "split", f"split_size can only be 0 if dimension size is 0, but got dimension {d} of size {size}")
        sizes = [min(step, size - s) for s in range(0, size, step)] if size else [0]
    else:
        sizes = list(_int_list(split_size_or_sections, "split: split_size_or_sections"))
        if any(s < 0 for s in sizes) or sum(sizes) != size:
            _fail(
                x,
                "split",
                f"split_with_sizes expects split_sizes to sum exactly to {size} (input tensor's size at "
                f"dimension {d}), but got split_sizes={sizes}",
            )
    parts, start = [], 0
    for s in sizes:
        parts.append(slice(x, d, start, start + s))
        start += s
    return parts


def chunk(x, chunks: int, dim: int = 0):
    """torch.chunk: split into ``chunks`` parts of ceil(size / chunks) (fewer if it divides so)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        _fail(x, "chunk", f"chunk expects `chunks` to be greater than 0, got: {chunks!r}")
    d = _wrap_dim(dim, len(x.shape), "chunk")
    size = x.shape[d] if x.shape else 1
    return split(x, max(cdiv(size, chunks), 1) if size else 0, d)


def expand(x, *sizes):
    """x broadcast to ``sizes`` (new dims in front; -1 keeps a size; only size-1 dims grow).
    Backward sums over the broadcast dims."""
    sizes = _sizes_arg(sizes, "expand: sizes")
    shape = tuple(x.shape)
    if len(sizes) < len(shape):
        _fail(
            x,
            "expand",
            f"the number of sizes provided ({len(sizes)}) must be greater or equal to the number of "
            f"dimensions in the tensor ({len(shape)})",
        )
    lead = len(sizes) - len(shape)
    target = []
    for i, s in enumerate(sizes):
        if i < lead:
            if s < 0:
                _fail(
                    x,
                    "expand",
                    f"the expanded size of the tensor ({s}) isn't allowed in a leading, non-existing dimension {i}",
                )
            target.append(s)
            continue
        have = shape[i - lead]
        if s == -1:
            s = have
        elif s < 0:
            _fail(x, "expand", f"invalid size {s} in {list(sizes)}")
        if have != s and have != 1:
            _fail(
                x,
                "expand",
                f"the expanded size of the tensor ({s}) must match the existing size ({have}) at "
                f"non-singleton dimension {i}. Target sizes: {list(sizes)}. Tensor sizes: {list(shape)}",
            )
        target.append(s)
    return _apply(x, ExpandOp("expand", tuple(target)))


def broadcast_to(x, shape):
    return expand(x, tuple(_int_list(shape, "broadcast_to: shape")))


def stop_gradient(x):
    """The value of x, through which no gradient flows (a view, no launch)."""
    return _apply(x, StopGradientOp("stop_gradient", tuple(x.shape)))


detach = stop_gradient
