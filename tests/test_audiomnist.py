"""The AudioMNIST loader on a tiny fixture in its published layout."""

import json

import numpy as np
import pytest
from scipy.io import wavfile

from tff_privacy.data import audiomnist, sources

SPEAKERS = {"01": {"gender": "male", "native speaker": "no", "accent": "German", "age": 30},
            "02": {"gender": "female", "native speaker": "yes", "accent": "English", "age": "27"},
            "03": {"gender": "male", "native speaker": "yes", "accent": "English", "age": "41"}}


def _tone(hz, seconds=0.3):
  t = np.arange(int(audiomnist.RATE * seconds)) / audiomnist.RATE
  return (0.5 * 32767 * np.sin(2 * np.pi * hz * t)).astype(np.int16)


@pytest.fixture
def data_dir(tmp_path):
  (tmp_path / audiomnist.META).write_text(json.dumps(SPEAKERS, indent=4))
  for speaker in SPEAKERS:
    (tmp_path / speaker).mkdir()
    for digit in range(10):
      for take in range(2):
        wavfile.write(tmp_path / speaker / f"{digit}_{speaker}_{take}.wav",
                      audiomnist.RATE, _tone(1000 + 500 * digit))
  return str(tmp_path)


def test_the_published_layout_loads_with_digits_and_attributes(data_dir):
  source = sources.load_source("audiomnist", data_dir)
  x = np.concatenate([source.x_train, source.x_test])
  assert x.shape == (60, 224, 224, 1) and source.num_classes == 10
  assert x.min() >= 0 and x.max() == pytest.approx(1.0)
  assert len(source.y_test) == 10 and sorted(source.y_test) == list(range(10))
  found = audiomnist.recordings(data_dir)
  # hand-mapped: 01 male non-native (2), 02 female native (1), 03 male native (0)
  identity = {"01": 2, "02": 1, "03": 0}
  gender = {"01": 1, "02": 0, "03": 1}
  y = np.concatenate([source.y_train, source.y_test])
  ids = np.concatenate([source.attributes.train["identity"], source.attributes.test["identity"]])
  assert sorted(zip(y.tolist(), ids.tolist())) == sorted(
      (digit, identity[spk]) for _, digit, spk in found)
  genders = np.concatenate([source.attributes.train["gender"], source.attributes.test["gender"]])
  assert sorted(genders.tolist()) == sorted(gender[spk] for _, _, spk in found)


def test_max_per_speaker_reads_each_speakers_first_files(data_dir):
  source = sources.load_source("audiomnist", data_dir,
                               {"max_per_speaker": 4, "test_fraction": 0.5})
  # sorted names: 0_SS_0, 0_SS_1, 1_SS_0, 1_SS_1 for each of 3 speakers
  y = np.concatenate([source.y_train, source.y_test])
  assert sorted(y.tolist()) == [0] * 6 + [1] * 6 and len(source.y_test) == 6


def test_a_tone_peaks_in_its_frequency_column(data_dir):
  image = audiomnist.spectrogram(f"{data_dir}/01/4_01_0.wav")  # 3,000 Hz
  bin_ = 3000 / audiomnist.RATE * 456  # of 229 frequencies
  column = (bin_ + 0.5) * 224 / 229 - 0.5
  assert abs(int(image[50].argmax()) - column) <= 1
  assert image[150].max() < 1e-3 * image[50].max()  # silence after 0.3 s


def test_missing_files_are_named(tmp_path, data_dir):
  with pytest.raises(ValueError, match="give data_dir"):
    sources.load_source("audiomnist", None)
  with pytest.raises(ValueError, match="needs audioMNIST_meta.txt"):
    sources.load_source("audiomnist", str(tmp_path / "01"))
  meta = json.loads(open(f"{data_dir}/{audiomnist.META}").read())
  del meta["03"]
  open(f"{data_dir}/{audiomnist.META}", "w").write(json.dumps(meta))
  with pytest.raises(ValueError, match=r"speakers \['03'\] are not in"):
    sources.load_source("audiomnist", data_dir)
