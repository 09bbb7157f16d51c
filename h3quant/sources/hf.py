"""A checkpoint named by its Hugging Face repository: ``ORG/NAME[@REV][:SUBFOLDER]``.

An argument that is not an existing path and has that form is looked up in the local Hugging
Face cache through ``huggingface_hub`` (the ``hf`` extra) and replaced by its snapshot folder
(``models--ORG--NAME/snapshots/<commit>/``, plus ``SUBFOLDER``), which the checkpoint reader
then opens like any folder of the cache (its links into ``blobs/`` are followed, others
refused: ``checkpoint``). ``REV`` is a branch, tag or commit the cache knows (default
``main``). Nothing is ever downloaded: a repository or revision missing from the cache is an
error that says how to fetch it. The cache is the one huggingface_hub uses: ``HF_HUB_CACHE``,
else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when the argument is resolved.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from h3quant.errors import ContainerError, UsageError

EXTRA = "pip install 'h3quant[hf]'"
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_SPEC = re.compile(rf"^(?P<org>{_PART})/(?P<name>{_PART})(?:@(?P<rev>[^:@\s]+))?"
                   r"(?::(?P<sub>[^:\s]+))?$")
_FILE_SUFFIXES = (".safetensors", ".json", ".gguf")  # a missing file, not a repository


def parse(arg: str) -> tuple[str, str | None, str | None] | None:
    """(``ORG/NAME``, revision or None, subfolder or None) when ``arg`` has the repository form;
    None otherwise (a file name such as ``dir/model.safetensors`` never has it)."""
    m = _SPEC.match(arg)
    if m is None or m["name"].endswith(_FILE_SUFFIXES) or (m["sub"] is None and m["rev"] is None
                                                           and arg.endswith(_FILE_SUFFIXES)):
        return None
    sub = m["sub"]
    if sub is not None:
        parts = PurePosixPath(sub).parts
        if sub.startswith("/") or any(p in ("..", ".") for p in parts):
            raise UsageError(f"{arg}: the subfolder {sub!r} must be a relative path inside the "
                             "repository")
    return f"{m['org']}/{m['name']}", m["rev"], sub


def cache_dir() -> Path:
    """The Hugging Face hub cache huggingface_hub reads (its environment variables)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return Path(home) / "hub"


def resolve(arg: str) -> str:
    """``arg`` itself when it is an existing path or not of the form ``ORG/NAME[@REV][:SUB]``;
    else the folder of the cached snapshot (``UsageError`` without huggingface_hub,
    ``ContainerError`` when the cache has no such repository, revision or subfolder)."""
    if os.path.lexists(arg):
        return arg
    spec = parse(arg)
    if spec is None:
        return arg
    repo, rev, sub = spec
    try:
        import huggingface_hub

        download = huggingface_hub.snapshot_download  # a lazy import inside the package
    except ImportError:
        raise UsageError(f"{arg} is not a file or folder; reading it as the Hugging Face "
                         f"repository {repo} needs huggingface_hub ({EXTRA})") from None
    except Exception as e:  # installed but unusable here (a build for another platform ...)
        raise UsageError(f"{arg} is not a file or folder; reading it as the Hugging Face "
                         f"repository {repo} needs huggingface_hub, which is installed but "
                         f"cannot be loaded ({type(e).__name__}: {e}); reinstall it "
                         f"({EXTRA})") from None
    cache = cache_dir()
    try:
        snap = Path(download(repo, revision=rev, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError, KeyError):  # LocalEntryNotFoundError (an OSError), a bad
        # revision ...: all mean "not here"; any other exception is no cache answer
        at = f" at revision {rev!r}" if rev else ""
        raise ContainerError(
            f"{arg} is not a file or folder, and the Hugging Face cache {cache} has no "
            f"snapshot of {repo}{at}; h3quant never downloads: fetch it "
            f"first (hf download {repo}" + (f" --revision {rev}" if rev else "") + ")") from None
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    _inside_repo(arg, repo_dir, snap, "the snapshot")
    path = snap / sub if sub else snap
    if not path.exists():
        raise ContainerError(f"{arg}: the cached snapshot of {repo} ({snap.name}) has no "
                             f"{sub!r}; it holds " + _listing(snap))
    if sub:
        _inside_repo(arg, repo_dir, path, f"the subfolder {sub!r}")
    if path.is_dir():
        entries = sorted(path.iterdir())[:MAX_ENTRIES]
        for entry in entries:
            if entry.is_symlink():
                _inside_repo(arg, repo_dir, entry, f"the link {entry.name!r}")
        if not any(e.name.endswith((".safetensors", ".gguf")) for e in entries):
            holding = [e.name for e in entries if e.is_dir() and any(
                f.name.endswith((".safetensors", ".gguf")) for f in e.iterdir())]
            if holding:
                base = f"{repo}@{rev}" if rev else repo
                raise ContainerError(
                    f"{arg}: the folder {path} holds no .safetensors file; its subfolder(s) "
                    + ", ".join(repr(h) for h in holding[:20]) + " do: name one, e.g. "
                    f"{base}:{(sub + '/') if sub else ''}{holding[0]}")
    return str(path)


MAX_ENTRIES = 10000  # entries of a snapshot folder whose links are checked


def _inside_repo(arg: str, repo_dir: Path, path: Path, what: str) -> None:
    """Refuse ``path`` unless it lies in ``repo_dir`` (``models--ORG--NAME``) both as named
    (``refs/main`` naming ``../..`` is caught here) and once every link is followed."""
    named = Path(os.path.normpath(os.path.abspath(path)))
    home = Path(os.path.normpath(os.path.abspath(repo_dir)))
    try:
        real, real_home = path.resolve(), repo_dir.resolve()
    except (OSError, RuntimeError) as e:
        raise ContainerError(f"{arg}: {what} cannot be resolved ({e})", path=str(path)) from None
    if not named.is_relative_to(home) or not real.is_relative_to(real_home):
        raise ContainerError(f"{arg}: {what} leads to {real}, outside the repository's cache "
                             f"folder {repo_dir}; a cache entry is read only inside its own "
                             "models--ORG--NAME folder", path=str(path))


def _listing(folder: Path) -> str:
    """The subfolders of a snapshot (what ``:SUBFOLDER`` may name), for an error message."""
    try:
        subs = sorted(p.name for p in folder.iterdir() if p.is_dir())[:20]
    except OSError:
        subs = []
    return ("the subfolders " + ", ".join(repr(s) for s in subs)) if subs else "no subfolders"
