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


def test_a_changed_file_makes_the_tree_dirty_with_its_diffs_hash(repo):
  (repo / "tff_privacy" / "a.py").write_text("x = 2\n")
  diff = _git(repo, "diff", "--binary", "HEAD")
  version = provenance.code_version(str(repo))
  assert version["dirty"] is True
  assert version["diff_sha256"] == hashlib.sha256(diff).hexdigest()
  # an untracked file under tff_privacy/ counts, its path and content after
  # the diff; one elsewhere does not
  (repo / "tff_privacy" / "new.py").write_bytes(b"y = 3\n")
  (repo / "notes.txt").write_text("scratch\n")
  want = hashlib.sha256(diff + b"tff_privacy/new.py\0y = 3\n").hexdigest()
  assert provenance.code_version(str(repo))["diff_sha256"] == want


def test_an_untracked_code_file_alone_makes_the_tree_dirty(repo):
  (repo / "experiments").mkdir()
  (repo / "experiments" / "e.py").write_bytes(b"z = 4\n")
  version = provenance.code_version(str(repo))
  assert version["dirty"] is True
  assert version["diff_sha256"] == hashlib.sha256(b"experiments/e.py\0z = 4\n").hexdigest()


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
  # without a checkout nothing can be told the same
  unknown = dict(provenance.UNKNOWN)
  assert provenance.note([unknown], unknown).startswith("made by an unknown")


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
