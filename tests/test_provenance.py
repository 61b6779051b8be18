"""The code version of a checkout, against git and hashlib run here on a
temporary repository, and the notes on results made by other code."""

import hashlib
import json
import os
import subprocess

import pytest

from tff_privacy import provenance

OTHER = {"commit": "a" * 40, "dirty": True, "diff_sha256": "b" * 64}


@pytest.fixture
def repo(tmp_path, monkeypatch):
  """A git checkout with one commit: tff_privacy/a.py and README."""
  # the user's git settings (diff prefixes, say) would change git's output
  monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
  monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
  (tmp_path / "tff_privacy").mkdir()
  (tmp_path / "tff_privacy" / "a.py").write_text("x = 1\n")
  (tmp_path / "README").write_text("read me\n")
  _git(tmp_path, "init", "-q")
  _git(tmp_path, "add", ".")
  _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
  return tmp_path


def _git(root, *args) -> bytes:
  return subprocess.run(["git", "-C", str(root), *args], check=True,
                        capture_output=True).stdout


def test_a_clean_checkout_is_its_commit(repo):
  head = _git(repo, "rev-parse", "HEAD").decode().strip()
  assert provenance.code_version(str(repo)) == {
      "commit": head, "dirty": False, "diff_sha256": None}


def _hashed(*entries) -> str:
  """The SHA-256 of (path, kind, data) `entries`, each field its length in
  8 big-endian bytes then itself, as provenance's docstring defines."""
  digest = hashlib.sha256()
  for entry in entries:
    for field in entry:
      digest.update(len(field).to_bytes(8, "big") + field)
  return digest.hexdigest()


def test_a_changed_file_makes_the_tree_dirty_with_its_contents_hash(repo):
  (repo / "tff_privacy" / "a.py").write_text("x = 2\n")
  version = provenance.code_version(str(repo))
  assert version["dirty"] is True
  assert version["diff_sha256"] == _hashed((b"tff_privacy/a.py", b"file", b"x = 2\n"))
  # an untracked file under tff_privacy/ counts, one elsewhere does not; a
  # tracked file counts anywhere, staged or not, deleted too
  (repo / "tff_privacy" / "new.py").write_bytes(b"y = 3\n")
  (repo / "notes.txt").write_text("scratch\n")
  (repo / "README").unlink()
  _git(repo, "add", "tff_privacy/a.py")
  assert provenance.code_version(str(repo))["diff_sha256"] == _hashed(
      (b"README", b"absent", b""), (b"tff_privacy/a.py", b"file", b"x = 2\n"),
      (b"tff_privacy/new.py", b"file", b"y = 3\n"))


def test_an_untracked_code_file_alone_makes_the_tree_dirty(repo):
  (repo / "experiments").mkdir()
  (repo / "experiments" / "e.py").write_bytes(b"z = 4\n")
  version = provenance.code_version(str(repo))
  assert version["dirty"] is True
  assert version["diff_sha256"] == _hashed((b"experiments/e.py", b"file", b"z = 4\n"))


def test_the_same_change_hashes_the_same_whatever_the_clone_or_git_settings(
    repo, tmp_path_factory):
  clone = tmp_path_factory.mktemp("clone") / "c"
  _git(repo, "clone", "-q", str(repo), str(clone))
  _git(clone, "config", "core.abbrev", "12")
  _git(clone, "config", "diff.algorithm", "patience")
  _git(clone, "config", "diff.noprefix", "true")
  for root in (repo, clone):
    (root / "tff_privacy" / "a.py").write_text("x = 1\ny = 2\n")
  # git's own diff text tells them apart ...
  assert (_git(repo, "diff", "--binary", "HEAD")
          != _git(clone, "diff", "--binary", "HEAD"))
  # ... their versions do not
  version = provenance.code_version(str(repo))
  assert version["dirty"] is True
  assert provenance.code_version(str(clone)) == version
  (clone / "tff_privacy" / "a.py").write_text("x = 1\ny = 3\n")
  changed = provenance.code_version(str(clone))
  assert changed["commit"] == version["commit"]
  assert changed["diff_sha256"] != version["diff_sha256"]


def test_files_that_cannot_be_read_hash_a_marker_instead_of_stopping(repo,
                                                                     monkeypatch):
  code = repo / "tff_privacy"
  _git(code, "init", "-q", "nested")  # a nested repository: a directory
  os.symlink("../nowhere", code / "link")
  (code / "locked.py").write_bytes(b"secret\n")
  (code / "swap.py").write_bytes(b"gone soon\n")
  real_git, real_open = provenance._git, open

  def git_then_delete_swap(root, *args):  # the file goes once listed
    out = real_git(root, *args)
    if "ls-files" in args:
      (code / "swap.py").unlink(missing_ok=True)
    return out

  def open_but_locked(path, *args, **kwargs):  # as root, chmod locks nothing
    if os.fsdecode(path).endswith("locked.py"):
      raise PermissionError(13, "Permission denied", path)
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr(provenance, "_git", git_then_delete_swap)
  monkeypatch.setattr(provenance, "open", open_but_locked, raising=False)
  odd = [(b"tff_privacy/link", b"symlink", b"../nowhere"),
         (b"tff_privacy/locked.py", b"unreadable", b""),
         (b"tff_privacy/nested/", b"directory", b""),
         (b"tff_privacy/swap.py", b"absent", b"")]
  assert provenance.code_version(str(repo))["diff_sha256"] == _hashed(*odd)
  (code / "a.py").unlink()
  os.mkfifo(code / "a.py")  # a tracked file become a pipe: never opened
  assert provenance.code_version(str(repo))["diff_sha256"] == _hashed(
      (b"tff_privacy/a.py", b"special", b""), *odd[:3])  # swap.py: gone, unlisted


def test_outside_a_checkout_or_below_its_top_no_version_is_told(repo, tmp_path_factory):
  plain = tmp_path_factory.mktemp("plain")
  assert provenance.code_version(str(plain)) == provenance.UNKNOWN
  assert provenance.code_version(str(repo / "tff_privacy")) == provenance.UNKNOWN


def test_a_result_of_other_code_is_noted_beside_the_current(repo):
  current = provenance.code_version(str(repo))
  assert provenance.note([current], current) is None
  assert provenance.note([OTHER], current) == (
      "made by commit aaaaaaaaaaaa with uncommitted changes (diff sha256 "
      f"bbbbbbbbbbbb); the code now is commit {current['commit'][:12]}")
  assert provenance.note([OTHER, current], current).startswith(
      "made partly by commit aaaaaaaaaaaa")
  assert provenance.note(provenance.versions_of({}), current).startswith(
      "made by an unrecorded code version")
  # without a checkout nothing can be compared with the code now
  unknown = dict(provenance.UNKNOWN)
  for versions in ([unknown], [OTHER], [None], [OTHER, unknown]):
    assert provenance.note(versions, unknown) is None


def test_a_tables_footnote_names_the_folders_of_other_codes_results(tmp_path,
                                                                   monkeypatch):
  current = {"commit": "c" * 40, "dirty": False, "diff_sha256": None}
  monkeypatch.setattr(provenance, "code_version", lambda: dict(current))
  for folder, record in (("same/run", {provenance.KEY: [current]}),
                         ("other/run", {provenance.KEY: [OTHER]}),
                         ("other/ig", {"mean": {}}),  # an attack.json before versions
                         ("old/attributes", {})):
    os.makedirs(tmp_path / folder)
    name = {"run": "config.json", "ig": "attack.json",
            "attributes": "attribute_round_0001_parity.json"}[folder.split("/")[1]]
    (tmp_path / folder / name).write_text(json.dumps(record))
  (tmp_path / "same" / "row.json").write_text("{}")  # not a result of the package
  text = provenance.footnote(str(tmp_path))
  assert "Code: commit cccccccccccc." in text
  lines = text.splitlines()
  assert ("- other/run: made by commit aaaaaaaaaaaa with uncommitted changes "
          "(diff sha256 bbbbbbbbbbbb); the code now is commit cccccccccccc") in lines
  assert ("- old/attributes, other/ig: made by an unrecorded code version; the "
          "code now is commit cccccccccccc") in lines
  assert "same" not in text


def test_without_a_known_version_a_footnote_names_no_folders(tmp_path, monkeypatch):
  monkeypatch.setattr(provenance, "code_version", lambda: dict(provenance.UNKNOWN))
  for folder, record in (("a", {provenance.KEY: [OTHER]}), ("b", {})):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / "config.json").write_text(json.dumps(record))
  assert provenance.footnote(str(tmp_path)) == (
      "\nCode: an unknown code version (not a git checkout).\n")


def test_files_that_are_not_json_objects_name_no_version(tmp_path):
  for folder, content in (("good", json.dumps({provenance.KEY: [OTHER]})),
                          ("old", "{}"), ("cut", '{"code_ver'), ("list", "[1, 2]"),
                          ("null", "null"), ("empty", "")):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / "config.json").write_text(content)
  os.makedirs(tmp_path / "binary")
  (tmp_path / "binary" / "attack.json").write_bytes(b"\xff\xfe\x00")
  assert provenance.recorded(str(tmp_path)) == {
      os.path.join("good", "config.json"): [OTHER],
      os.path.join("old", "config.json"): [None]}
