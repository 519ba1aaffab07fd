"""Download model repositories from ModelScope and Hugging Face over plain HTTPS.

No hub SDK: the listing APIs give each file's size and hash, files are fetched with
``httpx`` into ``NAME.part`` (resumed with a ``Range`` request after an interruption),
verified (size, then SHA-256 or the git blob SHA-1) and only then renamed into place,
so a path that exists is always a complete, verified file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

import httpx

MODELSCOPE_ENDPOINT = "https://modelscope.cn"
HUGGINGFACE_ENDPOINT = "https://huggingface.co"
CHUNK_BYTES = 1 << 20

Progress = Callable[[str, int, int], None]
"""``(relative path, bytes done, bytes total)``."""


class DownloadError(RuntimeError):
    """A listing or transfer failed, or a file did not match its published size or hash."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a hub repository and what it must hash to."""

    path: str
    url: str
    size: int
    sha256: str | None = None
    git_sha1: str | None = None
    """Git blob id: what Hugging Face publishes for files not stored in LFS."""


def modelscope_files(
    client: httpx.Client, model_id: str, revision: str = "master", endpoint: str = MODELSCOPE_ENDPOINT
) -> list[RemoteFile]:
    """Every file of a ModelScope model repository (``Files`` of its recursive listing)."""
    url = f"{endpoint}/api/v1/models/{model_id}/repo/files"
    body = _get_json(client, url, params={"Revision": revision, "Recursive": "true"})
    entries = (body.get("Data") or {}).get("Files")
    if not isinstance(entries, list):
        raise DownloadError(f"{url}: unexpected listing {str(body)[:200]}")
    return [
        RemoteFile(
            path=_safe_path(entry["Path"]),
            url=f"{endpoint}/models/{model_id}/resolve/{revision}/{quote(entry['Path'])}",
            size=int(entry["Size"]),
            sha256=entry.get("Sha256") or None,
        )
        for entry in entries
        if entry.get("Type") == "blob"
    ]


def huggingface_files(
    client: httpx.Client, repo_id: str, revision: str = "main", endpoint: str = HUGGINGFACE_ENDPOINT
) -> list[RemoteFile]:
    """Every file of a Hugging Face model repository (recursive tree listing)."""
    url = f"{endpoint}/api/models/{repo_id}/tree/{revision}"
    entries = _get_json(client, url, params={"recursive": "true"})
    if not isinstance(entries, list):
        raise DownloadError(f"{url}: unexpected listing {str(entries)[:200]}")
    files = []
    for entry in entries:
        if entry.get("type") != "file":
            continue
        lfs = entry.get("lfs")
        files.append(
            RemoteFile(
                path=_safe_path(entry["path"]),
                url=f"{endpoint}/{repo_id}/resolve/{revision}/{quote(entry['path'])}",
                size=int(entry["size"]),
                sha256=lfs["oid"] if lfs else None,
                git_sha1=None if lfs else entry.get("oid"),
            )
        )
    return files


def select(files: Iterable[RemoteFile], wanted: Iterable[str]) -> list[RemoteFile]:
    """The files of a listing that the deployment loads; every one of them must be listed."""
    by_path = {f.path: f for f in files}
    missing = sorted(set(wanted) - set(by_path))
    if missing:
        raise DownloadError(f"the repository does not list {', '.join(missing)}")
    return [by_path[path] for path in wanted]


def is_complete(path: Path, remote: RemoteFile) -> bool:
    """Whether ``path`` holds exactly the published file."""
    return path.is_file() and path.stat().st_size == remote.size and _hash_matches(path, remote)


def download_file(client: httpx.Client, remote: RemoteFile, dest: Path, progress: Progress | None = None) -> bool:
    """Fetch ``remote`` to ``dest`` unless it is already there; return whether bytes were fetched.

    A leftover ``dest.part`` is resumed. A file that fails verification is deleted and
    :class:`DownloadError` raised, so the next attempt starts clean.
    """
    if is_complete(dest, remote):
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    done = part.stat().st_size if part.exists() else 0
    if done > remote.size:
        part.unlink()
        done = 0
    if done < remote.size:
        done = _transfer(client, remote, part, done, progress)
    if done != remote.size or not _hash_matches(part, remote):
        part.unlink(missing_ok=True)
        raise DownloadError(f"{remote.path}: content does not match the published size/hash")
    os.replace(part, dest)
    return True


def download_all(
    client: httpx.Client, files: Iterable[RemoteFile], dest_dir: Path, progress: Progress | None = None
) -> int:
    """Download every file under ``dest_dir``; return how many were fetched (not already there)."""
    return sum(download_file(client, remote, dest_dir / remote.path, progress) for remote in files)


def _transfer(client: httpx.Client, remote: RemoteFile, part: Path, done: int, progress: Progress | None) -> int:
    # Identity encoding: byte offsets must refer to the file, not to a compressed stream.
    headers = {"Accept-Encoding": "identity"}
    if done:
        headers["Range"] = f"bytes={done}-"
    with client.stream("GET", remote.url, headers=headers, follow_redirects=True) as response:
        if response.status_code == 200 and done:
            # The server ignored the range: start over rather than append a second copy.
            done = 0
        elif response.status_code not in (200, 206):
            raise DownloadError(f"{remote.url}: HTTP {response.status_code}")
        with part.open("r+b" if done else "wb") as fh:
            fh.seek(done)
            fh.truncate()
            try:
                for chunk in response.iter_raw():
                    fh.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(remote.path, done, remote.size)
            except httpx.TransportError as exc:
                raise DownloadError(f"{remote.path}: transfer interrupted at {done} bytes ({exc})") from exc
    return done


def _hash_matches(path: Path, remote: RemoteFile) -> bool:
    if remote.sha256 is not None:
        digest = hashlib.sha256()
    elif remote.git_sha1 is not None:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return True
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest() == (remote.sha256 or remote.git_sha1)


def _get_json(client: httpx.Client, url: str, params: dict[str, str]) -> Any:
    try:
        response = client.get(url, params=params, follow_redirects=True)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise DownloadError(f"{url}: listing failed ({exc})") from exc


def _safe_path(path: str) -> str:
    """Refuse listing entries that would write outside the destination directory."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise DownloadError(f"refusing unsafe path {path!r} from a hub listing")
    return str(pure)
