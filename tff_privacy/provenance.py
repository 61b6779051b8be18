"""Which code made a result: its git commit, and whether the checkout had
uncommitted changes, with a hash of them.

A code version is {"commit": the checkout's HEAD (40 hex digits), "dirty":
whether the tree differs from it, "diff_sha256": the SHA-256 of how it
differs, None when it does not}; all three are None outside a git checkout
(an installed copy of the package, say), where no version can be told.

The files that differ are every path `git diff --name-only --no-renames
HEAD` names (tracked files anywhere in the checkout, staged or not, deleted
ones too) and every untracked file that git does not ignore under
tff_privacy/ and experiments/ (the code that makes results). The hash is
of their current state, not of diff text, so no git setting (abbreviated
hashes, diff algorithm) changes it: for each path in byte order, three
fields, each its length as 8 big-endian bytes then its bytes: the path
(relative to the top, `/`-separated), a kind and the kind's data:
b"file" and the file's bytes; b"symlink" and its target; b"absent" (a
deleted file, or one gone before it was read), b"directory" (a nested
repository, say), b"special" (a pipe, a socket, a device) or b"unreadable"
(a file that cannot be opened or read), each with empty data.

Results record the versions that made them under `KEY`, a list (a run
resumed by other code has several): runner's config.json, evaluate's
attack.json and attribute files, the leaderboard's row.json. A result
without the key was made before versions were recorded: its version is
unknown, None in the list.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import subprocess
from typing import Any, Optional, Sequence

from tff_privacy import io

KEY = "code_versions"
CODE_DIRS = ("tff_privacy", "experiments")
UNKNOWN = {"commit": None, "dirty": None, "diff_sha256": None}
_CHANGED = ("diff", "--name-only", "-z", "--no-renames", "--no-relative",
            "HEAD", "--")
_UNTRACKED = ("ls-files", "-z", "--others", "--exclude-standard", "--",
              *CODE_DIRS)


def code_version(root: Optional[str] = None) -> dict[str, Any]:
  """The code version of git checkout `root`; by default that of the
  checkout holding this package, as this process first read it (the code
  it imported, even if the files change while it runs)."""
  return dict(_own_version() if root is None else _version_of(root))


@functools.lru_cache(maxsize=1)
def _own_version() -> dict[str, Any]:
  return _version_of(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _version_of(root: str) -> dict[str, Any]:
  """`code_version` of `root`: UNKNOWN unless `root` is the top of a git
  checkout with a commit."""
  head = _git(root, "rev-parse", "--show-toplevel", "HEAD")
  top, commit = os.fsdecode(head).split("\n")[:2] if head else (None, None)
  if top is None or os.path.realpath(top) != os.path.realpath(root):
    return dict(UNKNOWN)
  changed, untracked = _git(root, *_CHANGED), _git(root, *_UNTRACKED)
  if changed is None or untracked is None:
    return dict(UNKNOWN)
  paths = sorted({p for p in (changed + b"\0" + untracked).split(b"\0") if p})
  return {"commit": commit, "dirty": bool(paths),
          "diff_sha256": _state_sha256(root, paths) if paths else None}


def _state_sha256(root: str, paths: Sequence[bytes]) -> str:
  """The SHA-256 of `paths` (relative to `root`, sorted) and their current
  state, as the module's docstring defines it."""
  digest = hashlib.sha256()
  for path in paths:
    kind, data = _state(os.path.join(os.fsencode(root), path))
    for field in (path, kind, data):
      digest.update(len(field).to_bytes(8, "big") + field)
  return digest.hexdigest()


def _state(path: bytes) -> tuple[bytes, bytes]:
  """The kind of what is at `path` now and its data (see the module's
  docstring); never raises for what the file system holds."""
  try:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
      return b"symlink", os.readlink(path)
    if stat.S_ISDIR(mode):
      return b"directory", b""
    if not stat.S_ISREG(mode):
      return b"special", b""
    # if it turned into a link or a pipe since, opening fails or reads nothing
    # rather than following it or waiting on it
    with open(path, "rb", opener=_no_follow) as f:
      return b"file", f.read()
  except FileNotFoundError:
    return b"absent", b""
  except OSError:
    return b"unreadable", b""


def _no_follow(path: bytes, flags: int) -> int:
  """A descriptor of file `path` opened with `flags`, failing on a symlink
  and not waiting on a pipe."""
  return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _git(root: str, *args: str) -> Optional[bytes]:
  """The output of git `args` in `root`; None where git fails or is missing."""
  try:
    done = subprocess.run(["git", "-C", root, *args], capture_output=True,
                          timeout=60, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return done.stdout if done.returncode == 0 else None


def versions_of(record: dict[str, Any]) -> list[Optional[dict[str, Any]]]:
  """The code versions a result's `record` names; [None] when it names none."""
  return record.get(KEY, [None])


def merged(*lists: Sequence[Optional[dict[str, Any]]]) -> list:
  """The versions of `lists`, each once, in order of first appearance."""
  out = []
  for version in (v for versions in lists for v in versions):
    if version not in out:
      out.append(version)
  return out


def describe(version: Optional[dict[str, Any]]) -> str:
  """A code version in words: its commit's first 12 digits and, for a dirty
  tree, its diff hash's."""
  if version is None:
    return "an unrecorded code version"
  if version["commit"] is None:
    return "an unknown code version (not a git checkout)"
  text = f"commit {version['commit'][:12]}"
  if version["dirty"]:
    text += f" with uncommitted changes (diff sha256 {version['diff_sha256'][:12]})"
  return text


def note(versions: Sequence[Optional[dict[str, Any]]],
         current: dict[str, Any]) -> Optional[str]:
  """Which of a result's `versions` are not `current` and which made it,
  beside the current one; None when they all are, or when `current` is
  unknown (nothing can be compared with it)."""
  if current["commit"] is None:
    return None
  others = [v for v in versions if v != current]
  if not others:
    return None
  made = ", ".join(describe(v) for v in others)
  if len(others) < len(versions):
    return f"made partly by {made}, partly by the code now ({describe(current)})"
  return f"made by {made}; the code now is {describe(current)}"


def recorded(folder: str) -> dict[str, list]:
  """The code versions of every result under `folder` (runs' config.json,
  attacks' attack.json and attribute_round_*.json files), keyed by path
  relative to `folder`; files that cannot be read or are not a JSON object
  name no version and are left out."""
  found = {}
  for parent, dirs, names in os.walk(folder):
    dirs.sort()
    for name in sorted(names):
      if name in ("config.json", "attack.json") or (
          name.startswith("attribute_round_") and name.endswith(".json")):
        path = os.path.join(parent, name)
        record = _record(path)
        if record is not None:
          found[os.path.relpath(path, folder)] = versions_of(record)
  return found


def _record(path: str) -> Optional[dict[str, Any]]:
  """The JSON object in file `path`; None when it cannot be read or holds
  no JSON object."""
  try:
    record = io.read_json(path)
  except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
    return None
  return record if isinstance(record, dict) else None


def footnote(out: str) -> str:
  """Markdown for a table of the results under `out`: the code version now
  and, for every result there made by another, its folder and versions."""
  current = code_version()
  folders = {}
  for path, versions in recorded(out).items():
    text = note(versions, current)
    if text:
      folders.setdefault(text, []).append(os.path.dirname(path) or ".")
  lines = ["", f"Code: {describe(current)}."]
  if folders:
    lines += ["", "Reused results made by other code (their folders in "
              f"{out}):"]
    lines += [f"- {', '.join(names)}: {text}" for text, names in folders.items()]
  return "\n".join(lines) + "\n"
