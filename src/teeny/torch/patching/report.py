"""What ``patch`` did to a model: ``PatchReport``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# the parts of a transformer ``coverage`` speaks of, in the order it lists them
PARTS = ("norms", "attention", "rotary", "mlp", "block", "head + loss")


@dataclass
class PatchReport:
    """What ``patch`` did: ``swapped`` (path, old class, new class), ``left`` (path, class, why), the
    functional calls it routes, and at run time ``routed``/``fallbacks`` counts (of eager calls:
    under ``torch.compile`` a count would be a guard that fails every call). ``fallbacks``
    counts, by (name, why), the routed calls PyTorch ran and the one-call forwards that ran as
    their layers' calls (a PEFT adapter on a layer whose weight they read). ``coverage()`` says
    per part of a transformer (norms, attention, rotary, MLP, block, head + loss) what runs it."""

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    functional: list[str] = field(default_factory=list)
    routed: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    fused_loss: str = ""  # the head + loss fused, or why not ("" when the model has no LM head)
    autocast_norms: list[str] = field(default_factory=list)  # pre-norms that write autocast's dtype (see patch)
    parts: dict[str, Counter] = field(default_factory=dict)  # part -> Counter of what runs each module of it

    def note(self, part: str, status: str) -> None:
        """Count one module of ``part`` (one of ``PARTS``) as run by ``status``."""
        self.parts.setdefault(part, Counter())[status] += 1

    def coverage(self) -> dict[str, str]:
        """Part -> what runs it: one status ("teeny: ...", "PyTorch: ...") when every module of
        that part runs the same way, else each with its count; "-" for a part the model lacks."""
        out = {}
        for part in PARTS:
            statuses = self.parts.get(part)
            if not statuses:
                out[part] = "-"
            elif len(statuses) == 1:
                out[part] = next(iter(statuses))
            else:
                out[part] = "; ".join(f"{status} (x{n})" for status, n in sorted(statuses.items()))
        return out

    def __str__(self) -> str:
        kinds = Counter(new for _, _, new in self.swapped)
        lines = [f"teeny.torch.patch: swapped {len(self.swapped)} modules"]
        lines += [f"  {count:4d} x {name}" for name, count in sorted(kinds.items())]
        lines.append(f"  routes {len(self.functional)} functional calls (F.scaled_dot_product_attention, ...)")
        if self.fused_loss:
            lines.append(f"  head + loss: {self.fused_loss}")
        if self.autocast_norms:
            n = len(self.autocast_norms)
            lines.append(f"  {n} pre-norms write autocast's dtype under autocast (products read them)")
        lines.append("  coverage: " + ", ".join(f"{part}: {what}" for part, what in self.coverage().items()))
        if self.routed:
            lines.append("  routed so far: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.routed.items())))
        if self.fallbacks:
            lines.append(
                "  run by PyTorch, or as separate calls (teeny has no kernel for that call, or a layer changed):"
            )
            lines += [f"    {name}: {why} (x{n})" for (name, why), n in sorted(self.fallbacks.items())]
        if self.left:
            lines.append(f"  left {len(self.left)} modules to PyTorch:")
            lines += [f"    {path or '<root>'} ({cls}): {why}" for path, cls, why in self.left]
        return "\n".join(lines)
