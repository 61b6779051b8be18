"""AudioMNIST (Becker et al.), RECUP-FL's audio data, from its published
layout: DATA_DIR/<speaker>/<digit>_<speaker>_<take>.wav (16-bit mono, 48
kHz; 60 speakers x 10 digits x 50 takes) and DATA_DIR/audioMNIST_meta.txt
(a JSON object of each speaker's "gender", "native speaker", "accent",
"age", ...).

Task: the spoken digit. Sensitive attributes: gender (female, male) and
RECUP-FL's identity (Sec. 6.1: male native speaker, female native speaker,
male non-native speaker, female non-native speaker).

Spectrograms (the paper's model reads 224 x 224 inputs and says only that
the audio is processed "into a spectrogram"): each recording is cut or
zero-padded to 1 s (48,000 samples), its short-time Fourier transform taken
with 455-sample frames every 212 samples (225 frames, 229 frequencies),
log(1 + |STFT|) resized bilinearly to 224 x 224, then divided by the largest
value over the data set so that inputs lie in [0, 1]. At full size that is
6 GB of float32; `max_per_speaker` reads fewer takes.

The split is 80/20, stratified by digit, with a fixed seed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np
import tensorflow as tf
from scipy.io import wavfile

META = "audioMNIST_meta.txt"
RATE = 48_000
SIDE = 224
ATTRIBUTE_CLASSES = {
    "gender": ("female", "male"),
    "identity": ("male native speaker", "female native speaker",
                 "male non-native speaker", "female non-native speaker"),
}
_NAME = re.compile(r"^(\d)_(\d+)_(\d+)\.wav$")


def read_meta(data_dir: str) -> dict:
  """The speakers' metadata, {speaker id: {...}}.

  Raises:
    ValueError: naming the file when it is missing or not JSON.
  """
  path = os.path.join(data_dir, META)
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"data_dir={data_dir!r}: AudioMNIST needs {META} there "
                     f"(the published layout) ({e})") from None


def speaker_attributes(meta: dict) -> dict:
  """{speaker: {'gender': index, 'identity': index}} from the metadata."""
  out = {}
  for speaker, info in meta.items():
    gender = str(info["gender"]).strip().lower()
    native = str(info["native speaker"]).strip().lower() == "yes"
    if gender not in ATTRIBUTE_CLASSES["gender"]:
      raise ValueError(f"{META}: speaker {speaker} has gender {info['gender']!r}")
    identity = f"{gender} {'native' if native else 'non-native'} speaker"
    out[speaker] = {"gender": ATTRIBUTE_CLASSES["gender"].index(gender),
                    "identity": ATTRIBUTE_CLASSES["identity"].index(identity)}
  return out


def recordings(data_dir: str, max_per_speaker: Optional[int] = None) -> list:
  """(path, digit, speaker) of every recording, sorted; at most
  `max_per_speaker` per speaker."""
  found = []
  for speaker in sorted(os.listdir(data_dir)):
    folder = os.path.join(data_dir, speaker)
    if not os.path.isdir(folder):
      continue
    mine = sorted(n for n in os.listdir(folder) if _NAME.match(n))
    for name in mine[:max_per_speaker]:
      digit, spk, _ = _NAME.match(name).groups()
      found.append((os.path.join(folder, name), int(digit), spk))
  if not found:
    raise ValueError(f"data_dir={data_dir!r} holds no <speaker>/<digit>_<speaker>_"
                     "<take>.wav recordings (the AudioMNIST layout)")
  return found


def spectrogram(path: str) -> np.ndarray:
  """log(1 + |STFT|) of one recording, [224, 224] (see the module)."""
  rate, wave = wavfile.read(path)
  if rate != RATE:
    raise ValueError(f"{path}: sample rate {rate}, AudioMNIST's is {RATE}")
  wave = np.asarray(wave, np.float32) / 32768.0
  wave = np.pad(wave[:RATE], (0, max(0, RATE - len(wave))))
  magnitude = tf.abs(tf.signal.stft(wave, frame_length=455, frame_step=212,
                                    fft_length=456))
  image = tf.image.resize(tf.math.log1p(magnitude)[..., None], (SIDE, SIDE))
  return image.numpy()[..., 0]
