"""The bundle file: targets, the manifest, reading, writing and the compatibility checks.

Pure Python (stdlib only, no torch, no Triton, no teeny device): the build's caller, the
target-emulating worker and the loader all use it, and tests check refusals without a GPU.
The format is described in ``teeny.aot``'s docstring.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "teeny-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# Streaming multiprocessors of the usual card of each arch (H100/H200 SXM, A100). Norm backward
# grids are a few programs per SM, so a plan is made for one SM count; give another with
# ``cuda:90@114`` (H100 PCIe). Other archs must say theirs.
DEFAULT_SM_COUNT = {80: 108, 90: 132}
_TARGET = re.compile(r"^(?P<backend>[a-z]+):(?P<arch>\d+)(?:@(?P<sms>\d+))?$")


class BundleError(Exception):
    """A bundle cannot be built or used here: bad target, wrong version, damaged file."""


@dataclass(frozen=True)
class Target:
    """A GPU to compile for: CUDA compute capability ``arch`` (90 = sm_90) with ``sm_count`` SMs."""

    arch: int
    sm_count: int
    backend: str = "cuda"
    warp_size: int = 32

    @property
    def name(self) -> str:
        """``cuda:90``: how bundles, messages and ``--target`` name the target."""
        return f"{self.backend}:{self.arch}"

    @property
    def key(self) -> str:
        """The target's folder in the bundle (``cuda90``)."""
        return f"{self.backend}{self.arch}"

    def __str__(self) -> str:
        return f"{self.name}@{self.sm_count}"

    @classmethod
    def parse(cls, text: str) -> Target:
        """``cuda:90`` or ``cuda:90@132`` (an SM count other than the arch's usual card)."""
        match = _TARGET.match(text.strip().lower())
        if match is None:
            raise BundleError(f"target {text!r}: expected cuda:ARCH or cuda:ARCH@SMS, e.g. cuda:90 (sm_90) or cuda:80")
        if match["backend"] != "cuda":
            raise BundleError(f"target {text!r}: only CUDA targets can be built (cuda:80, cuda:90, ...)")
        arch = int(match["arch"])
        if arch < 75 or arch % 10 > 9:
            raise BundleError(
                f"target {text!r}: Triton compiles for CUDA compute capability 7.5 and newer (cuda:75 ..)"
            )
        sms = match["sms"]
        if sms is None:
            if arch not in DEFAULT_SM_COUNT:
                raise BundleError(
                    f"target {text!r}: no usual SM count is known for sm_{arch}; say it, e.g. cuda:{arch}@84"
                )
            return cls(arch, DEFAULT_SM_COUNT[arch])
        if int(sms) < 1:
            raise BundleError(f"target {text!r}: the SM count must be >= 1")
        return cls(arch, int(sms))


def parse_targets(spec: str | Target | list) -> list[Target]:
    """``"cuda:90,cuda:80"`` (or a list of names or ``Target``s) -> targets, each once."""
    items = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else [spec]
    targets: list[Target] = []
    for item in items:
        target = item if isinstance(item, Target) else Target.parse(str(item))
        if any(t.name == target.name for t in targets):
            raise BundleError(f"target {target.name} is given twice")
        targets.append(target)
    if not targets:
        raise BundleError("no target given (e.g. --target cuda:90)")
    return targets


# ------------------------------------------------------------------------------ files


def write_bundle(path: str | Path, manifest: dict, files: dict[str, bytes]) -> Path:
    """Write ``manifest`` and ``files`` (archive name -> bytes) as one zip archive, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for name, data in files.items():
            archive.writestr(name, data)
    tmp.replace(path)
    return path


class Bundle:
    """An opened bundle: its manifest, and its files read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise BundleError(f"bundle {self.path} does not exist")
        try:
            with zipfile.ZipFile(self.path) as archive:
                self._data = {name: archive.read(name) for name in archive.namelist()}
        except (zipfile.BadZipFile, OSError) as exc:
            raise BundleError(f"{self.path} is not a teeny bundle (not a readable archive: {exc})") from None
        if MANIFEST not in self._data:
            raise BundleError(f"{self.path} is not a teeny bundle (no {MANIFEST})")
        self.manifest = json.loads(self._data[MANIFEST])
        if self.manifest.get("format") != FORMAT:
            raise BundleError(f"{self.path} is not a teeny bundle (format {self.manifest.get('format')!r})")

    def read(self, name: str) -> bytes:
        try:
            return self._data[name]
        except KeyError:
            raise BundleError(f"bundle {self.path} is damaged: {name} is missing") from None

    def json(self, name: str) -> Any:
        return json.loads(self.read(name))

    def has(self, name: str) -> bool:
        return name in self._data

    def plan(self, target: str) -> dict:
        """The plan (program, buffers, launches, kernels) for the target named ``target``."""
        entry = next((t for t in self.manifest["targets"] if t["name"] == target), None)
        if entry is None:
            raise BundleError(f"bundle {self.path} has no target {target} (it has {', '.join(self.target_names())})")
        return self.json(entry["plan"])

    def target_names(self) -> list[str]:
        return [t["name"] for t in self.manifest["targets"]]


def check_versions(manifest: dict, teeny_version: str, triton_version: str, where: str = "bundle") -> None:
    """Refuse a manifest of another format version, teeny or Triton: compiled kernels only run
    with the Triton that built them (its launch ABI and cache keys), and the plan only fits the
    teeny whose ops made it."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{where} has format version {version}, but this teeny reads version {FORMAT_VERSION}: rebuild it "
            "with `teeny build`"
        )
    if manifest.get("teeny_version") != teeny_version:
        raise BundleError(
            f"{where} was built by teeny {manifest.get('teeny_version')}, this is teeny {teeny_version}: its plan "
            "and kernels may not fit this teeny's ops; rebuild it with `teeny build`"
        )
    if manifest.get("triton_version") != triton_version:
        raise BundleError(
            f"{where} was compiled by Triton {manifest.get('triton_version')}, this is Triton {triton_version}: "
            "compiled kernels only run with the Triton that built them; rebuild it with `teeny build`"
        )


def select_target(manifest: dict, arch: int, sm_count: int, where: str = "bundle") -> tuple[dict, str | None]:
    """The manifest's entry for a GPU of compute capability ``arch`` (e.g. 90), and a warning
    when it was planned for another SM count (launches whose specialisation depends on it are
    then refused at launch)."""
    names = [t["name"] for t in manifest["targets"]]
    entry = next((t for t in manifest["targets"] if t["arch"] == arch), None)
    if entry is None:
        raise BundleError(
            f"{where} holds kernels for {', '.join(names)}, but this GPU is cuda:{arch} (sm_{arch}): "
            f"build it with --target cuda:{arch}"
        )
    warning = None
    if entry["sm_count"] != sm_count:
        warning = (
            f"{where}: target {entry['name']} was planned for {entry['sm_count']} SMs, this GPU has {sm_count}; "
            f"launches that depend on the SM count will be refused (build with --target {entry['name']}@{sm_count})"
        )
    return entry, warning
