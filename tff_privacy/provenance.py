"""Which code made a result: its git commit, and whether the checkout had
uncommitted changes, with a hash of them.

A code version is {"commit": the checkout's HEAD (40 hex digits), "dirty":
whether the tree differs from it, "diff_sha256": the SHA-256 of how it
differs, None when it does not}; all three are None outside a git checkout
(an installed copy of the package, say), where no version can be told.
The difference hashed is the output of `git diff --binary HEAD` (every
tracked file, staged or not) followed, for each untracked file that git
does not ignore under tff_privacy/ and experiments/ (the code that makes
results), in path order, by its path, a NUL byte and its content.

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
import subprocess
from typing import Any, Optional, Sequence

from tff_privacy import io

KEY = "code_versions"
CODE_DIRS = ("tff_privacy", "experiments")
UNKNOWN = {"commit": None, "dirty": None, "diff_sha256": None}
# the options neutralise a user's diff settings, which would change the text
_DIFF = ("diff", "--binary", "--no-color", "--no-ext-diff", "--no-textconv",
         "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", "HEAD", "--")


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
  diff = _git(root, *_DIFF)
  untracked = _git(root, "ls-files", "-z", "--others", "--exclude-standard",
                   "--", *CODE_DIRS)
  if diff is None or untracked is None:
    return dict(UNKNOWN)
  digest = hashlib.sha256(diff)
  paths = sorted(p for p in untracked.split(b"\0") if p)
  for path in paths:
    with open(os.path.join(os.fsencode(root), path), "rb") as f:
      digest.update(path + b"\0" + f.read())
  dirty = bool(diff or paths)
  return {"commit": commit, "dirty": dirty,
          "diff_sha256": digest.hexdigest() if dirty else None}


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
  """None when a result's `versions` are all `current`, a known version;
  else which versions made it, beside the current one."""
  same = current["commit"] is not None
  others = [v for v in versions if not (same and v == current)]
  if not others:
    return None
  made = ", ".join(describe(v) for v in others)
  if len(others) < len(versions):
    return f"made partly by {made}, partly by the code now ({describe(current)})"
  return f"made by {made}; the code now is {describe(current)}"


def recorded(folder: str) -> dict[str, list]:
  """The code versions of every result under `folder` (runs' config.json,
  attacks' attack.json and attribute_round_*.json files), keyed by path
  relative to `folder`."""
  found = {}
  for parent, dirs, names in os.walk(folder):
    dirs.sort()
    for name in sorted(names):
      if name in ("config.json", "attack.json") or (
          name.startswith("attribute_round_") and name.endswith(".json")):
        path = os.path.join(parent, name)
        found[os.path.relpath(path, folder)] = versions_of(io.read_json(path))
  return found


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
