"""A checkpoint: one .safetensors file, a sharded set with its index, or a directory of either."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant.errors import ClosedError, ContainerError
from h3quant.findings import Finding
from h3quant.formats.container import jsonsafe
from h3quant.formats.container.reader import (
    SafetensorsFile,
    TensorInfo,
    open_input,
    raise_first_error,
)

if TYPE_CHECKING:
    import torch

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a 50 000-tensor index is ~4 MB


def _cache_repo(folder: Path) -> Path | None:
    """The Hugging Face cache repository folder (``models--ORG--NAME``, ``datasets--*``, ...)
    holding ``folder``, found on the path as given (before links are followed), or None."""
    for parent in (folder, *folder.parents):
        if parent.name.startswith(("models--", "datasets--", "spaces--")):
            return parent
    return None


def _described(findings: list[Finding], f: Path) -> list[Finding]:
    """A header-length finding (C101) on a file whose first bytes show what it is (a PyTorch
    pickle, a .gguf without the magic) says that instead of a raw length."""
    from h3quant.formats.container.sniff import describe

    if not any(x.code == "C101" for x in findings):
        return findings
    what = describe(f)
    if what is None:
        return findings
    return [Finding("C101", what, file=x.file) if x.code == "C101" else x for x in findings]


def _inside(root: Path, fname: str, folder: Path | None = None) -> str | None:
    """Why a shard name from an index is refused, or None when it is accepted: one plain path
    component naming a file inside ``root`` (the index's resolved directory). A symbolic link
    is followed only inside a Hugging Face cache repository folder (``snapshots/<rev>/`` ->
    ``../../blobs/``): it must resolve inside that same ``models--*`` folder."""
    if not fname or "\0" in fname or "/" in fname or "\\" in fname or fname in (".", ".."):
        return "which is not a plain file name"
    try:
        candidate = root / fname
        if candidate.is_symlink():
            target = candidate.resolve()
            repo = _cache_repo(folder if folder is not None else root)
            if repo is not None and target.is_relative_to(repo.resolve()):
                return None
            if repo is None:
                return (f"a symbolic link to {target}; shards may be symbolic links only inside "
                        "a Hugging Face cache repository folder (models--ORG--NAME)")
            return (f"a symbolic link to {target}, outside its Hugging Face cache repository "
                    f"folder {repo}")
        if candidate.resolve().parent == root:
            return None
    except (OSError, RuntimeError, ValueError):
        pass
    return "which is not a file inside the index's directory"


def _resolve(path: Path) -> tuple[list[Path], Path | None]:
    """(shard files, index file or None) for a file, an index or a directory."""
    if path.is_dir():
        indexes = sorted(path.glob("*" + INDEX_SUFFIX))
        if len(indexes) == 1:
            return [], indexes[0]
        if len(indexes) > 1:
            raise ContainerError(f"several shard indexes: {', '.join(p.name for p in indexes)}; "
                                 "name one", path=path, code="S101")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ContainerError("directory holds no .safetensors file", path=path, code="C112")
        return files, None
    if path.name.endswith(".index.json"):
        return [], path
    if not path.exists():
        raise ContainerError("no such file", path=path, code="C112")
    return [path], None


class Checkpoint:
    """Every tensor of a (possibly sharded) checkpoint, read lazily one at a time."""

    def __init__(self, path: str | os.PathLike, *, mmap: bool = True, strict: bool = True):
        self.path = Path(path)
        self._closed = False
        self.findings: list[Finding] = []
        self.files: list[SafetensorsFile] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.index_metadata: dict = {}
        self._by_path: dict[Path, SafetensorsFile] = {}
        try:
            files, index = _resolve(self.path)
            self.index_path = index
            weight_map = self._load_index(index) if index else None
            if index is not None and weight_map is not None:
                files = sorted({index.parent / f for f in weight_map.values()})
                self._unindexed_shards(index, files)
            for f in files:
                self._open_file(f, mmap)
            self._collect(weight_map)
            if strict:
                raise_first_error(self.findings)
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------------------------
    def _load_index(self, index: Path) -> dict[str, str] | None:
        """The index's weight_map. The index is untrusted: bounded size, sane JSON, and every
        shard it names is a plain file name inside the index's directory, or a symbolic link
        within the same Hugging Face cache repository folder (S106)."""
        with open_input(index, what="shard index") as fh:
            raw = fh.read(MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            self.findings.append(Finding("S101", f"index is larger than {MAX_INDEX_BYTES} bytes",
                                         file=str(index)))
            return {}
        try:
            obj = jsonsafe.loads(raw)
        except ValueError as exc:
            self.findings.append(Finding("S101", f"cannot read index: {exc}", file=str(index)))
            return {}
        wm = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            self.findings.append(Finding("S101", "index has no weight_map of tensor -> file name",
                                         file=str(index)))
            return {}
        meta = obj.get("metadata")
        self.index_metadata = meta if isinstance(meta, dict) else {}
        root = index.parent.resolve()
        safe: dict[str, str] = {}
        refused: set[str] = set()
        for name, fname in wm.items():
            if fname in refused:
                continue
            why = _inside(root, fname, index.parent.absolute())
            if why is not None:
                refused.add(fname)
                self.findings.append(Finding(
                    "S106", f"index names shard {fname!r}, {why}; not opened", file=str(index)))
                continue
            safe[name] = fname
        return safe

    def _unindexed_shards(self, index: Path, files: list[Path]) -> None:
        named = {f.name for f in files}
        for f in sorted(index.parent.glob("*.safetensors")):
            if f.name not in named:
                self.findings.append(Finding(
                    "S108", "shard beside the index is not named by it (not read)",
                    file=str(f)))

    def _open_file(self, f: Path, mmap: bool) -> None:
        if not f.exists():
            self.findings.append(Finding("S102", "shard named by the index does not exist", file=str(f)))
            return
        try:
            sf = SafetensorsFile(f, mmap=mmap, strict=False)
        except ContainerError as exc:
            self.findings.append(Finding(exc.code or "C112", exc.reason, file=str(f)))
            return
        self.files.append(sf)
        self._by_path[f] = sf
        self.findings.extend(_described(sf.findings, f))

    def _collect(self, weight_map: dict[str, str] | None) -> None:
        for sf in self.files:
            for name, info in sf.tensors.items():
                if name in self.tensors:
                    self.findings.append(Finding(
                        "S104", f"stored in both {self.tensors[name].file.name} and {sf.path.name}",
                        tensor=name, file=str(sf.path)))
                    continue
                self.tensors[name] = info
                if weight_map is not None and name not in weight_map:
                    self.findings.append(Finding("S105", "stored in a shard but not listed in the index",
                                                 tensor=name, file=str(sf.path)))
                elif weight_map is not None and weight_map[name] != sf.path.name:
                    self.findings.append(Finding(
                        "S107", f"index places it in {weight_map[name]}, found in "
                        f"{sf.path.name}", tensor=name, file=str(sf.path)))
        if weight_map:
            opened = {sf.path.name for sf in self.files}
            for name, fname in weight_map.items():
                if fname in opened and name not in self.tensors:
                    self.findings.append(Finding("S103", f"index places it in {fname}, which lacks it",
                                                 tensor=name, file=fname))
        self.tensors = dict(sorted(self.tensors.items()))

    # -- queries -------------------------------------------------------------------------------
    @property
    def is_sharded(self) -> bool:
        return self.index_path is not None or len(self.files) > 1

    @property
    def metadata(self) -> dict[str, str]:
        """``__metadata__`` merged over shards (the first shard holding a key wins)."""
        merged: dict[str, str] = {}
        for sf in self.files:
            for k, v in sf.metadata.items():
                merged.setdefault(k, v)
        return merged

    @property
    def total_bytes(self) -> int:
        return sum(sf.file_size for sf in self.files)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ContainerError("no such tensor in the checkpoint", path=self.path, tensor=name) from None

    def file_of(self, name: str) -> SafetensorsFile:
        if self._closed:
            raise ClosedError("this checkpoint was closed; open it again to read "
                              f"'{name}'", path=self.path)
        return self._by_path[self.info(name).file]

    def read(self, name: str) -> torch.Tensor:
        return self.file_of(name).read(self.info(name))

    def read_bytes(self, name: str):
        return self.file_of(name).read_bytes(self.info(name))

    def iter_bytes(self, name: str, chunk: int | None = None) -> Iterator:
        sf = self.file_of(name)
        info = self.info(name)
        return sf.iter_bytes(info) if chunk is None else sf.iter_bytes(info, chunk)

    def check_unchanged(self) -> None:
        """``ContainerError`` if any file was modified, truncated or replaced since opening."""
        for sf in self.files:
            sf.check_unchanged()

    def close(self) -> None:
        """Close every file; any later read raises ``ClosedError``."""
        self._closed = True
        for sf in self.files:
            sf.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike, *, mmap: bool = True, strict: bool = True) -> Checkpoint:
    return Checkpoint(path, mmap=mmap, strict=strict)
