"""Where the GPU idles between the kernels of profiled steps (torch.profiler): used by
``bench/torch_models.py --profile`` and ``bench/steps.py --profile``."""

from __future__ import annotations


def kernel_gaps(prof, steps: int, top: int = 12) -> str:
    """Where the GPU idles between kernels: per step, the kernels, the time some kernel runs and
    the idle time between the first start and the last end; then the pairs of neighbouring
    kernels with the most idle time between them, summed over the steps."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return "no kernels recorded"
    idle, busy, by_pair = 0.0, 0.0, defaultdict(lambda: [0.0, 0])
    end, last = kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gap = start - end
            idle += gap
            by_pair[(last[:48], name[:48])][0] += gap
            by_pair[(last[:48], name[:48])][1] += 1
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    lines = [
        f"kernels: {len(kernels) / steps:.0f} a step, busy {busy / steps / 1e3:.2f} ms, idle between them "
        f"{idle / steps / 1e3:.2f} ms a step (steps' own ends and starts included)",
        f"{'idle us a step':>15} {'gaps':>5}  after -> before",
    ]
    for (after, before), (total, count) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{total / steps:15.1f} {count // steps:5d}  {after} -> {before}")
    return "\n".join(lines)
