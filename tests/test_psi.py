"""PSI scores (FedRE eqs. 3-5) against central finite differences of the
gradient, computed here in float64 from the same network in numpy."""

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import models, psi

H, W, C = 5, 4, 2


@pytest.fixture(scope="module")
def setup():
  spec = models.ModelSpec("mlp", (H, W, C), 3,
                          {"hidden": (6,), "activation": "sigmoid"})
  model = spec.keras(0)
  weights = [w.astype(np.float64) for w in spec.initial_weights(0)]
  rng = np.random.default_rng(1)
  x = rng.random((2, H, W, C))
  y = np.array([0, 2])
  masks = np.zeros((2, H, W), bool)
  masks[0, 1:3, 1:4] = True
  masks[1, 0, 0] = masks[1, 4, 3] = True
  return model, weights, x, y, masks


def _np_gradient(weights, x1, y1):
  """Cross-entropy gradient of the one-hidden-layer sigmoid MLP, by hand."""
  k1, b1, k2, b2 = weights
  v = x1.reshape(-1)
  h = 1 / (1 + np.exp(-(v @ k1 + b1)))
  z = h @ k2 + b2
  p = np.exp(z - z.max())
  p /= p.sum()
  dz = p - np.eye(len(p))[y1]
  dh = (k2 @ dz) * h * (1 - h)
  return [np.outer(v, dh), dh, np.outer(h, dz), dz]


def _fd_pixel_norms(weights, x1, y1, step=1e-5):
  """Eq. 4 at every pixel from central differences of the gradient: [L, H, W]."""
  squares = np.zeros((len(weights), H, W))
  for a in range(H):
    for b in range(W):
      for c in range(C):
        plus, minus = x1.copy(), x1.copy()
        plus[a, b, c] += step
        minus[a, b, c] -= step
        for l, (gp, gm) in enumerate(zip(_np_gradient(weights, plus, y1),
                                         _np_gradient(weights, minus, y1))):
          squares[l, a, b] += np.sum(((gp - gm) / (2 * step)) ** 2)
  return np.sqrt(squares)


def _fd_scores(weights, x, y, masks):
  return np.stack([(_fd_pixel_norms(weights, x[i], y[i]) * masks[i]).sum((1, 2))
                   / masks[i].sum() for i in range(len(x))])


def _f32(weights):
  return [tf.constant(w, tf.float32) for w in weights]


def test_nested_tape_jacobian_matches_finite_differences(setup):
  model, weights, x, y, masks = setup
  expected = _fd_pixel_norms(weights, x[0], y[0])
  got = psi.pixel_norms_nested_tape(model, _f32(weights), x[0], y[0]).numpy()
  np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)


@pytest.mark.slow
def test_nested_tape_scores_match_finite_differences(setup):
  model, weights, x, y, masks = setup
  got = psi.psi_scores_nested_tape(model, _f32(weights), x, y, masks).numpy()
  np.testing.assert_allclose(got, _fd_scores(weights, x, y, masks), rtol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_forward_mode_scores_match_finite_differences(setup, chunk):
  model, weights, x, y, masks = setup
  got = psi.psi_scores(model, _f32(weights), x, y, masks, chunk=chunk)
  np.testing.assert_allclose(got.scores.numpy(), _fd_scores(weights, x, y, masks),
                             rtol=2e-4)
  assert not got.standard_error.numpy().any()


@pytest.mark.slow
def test_scores_do_not_overflow_where_the_derivatives_do_not(setup):
  # a loss scaled by 1e22 scales every score by 1e22: derivatives near 1e21,
  # whose squares (1e42) are past float32's range
  model, weights, x, y, masks = setup
  scale = 1e22
  loss = lambda out, labels: scale * psi.scores.CLASSIFICATION_LOSS(out, labels)
  expected = scale * _fd_scores(weights, x, y, masks)
  fast = psi.psi_scores(model, _f32(weights), x, y, masks, loss).scores.numpy()
  nested = psi.psi_scores_nested_tape(model, _f32(weights), x, y, masks, loss).numpy()
  np.testing.assert_allclose(fast, expected, rtol=2e-4)
  np.testing.assert_allclose(nested, expected, rtol=2e-4)


@pytest.mark.slow
def test_forward_mode_runs_in_a_graph_with_the_mask_as_input(setup):
  model, weights, x, y, masks = setup
  fn = tf.function(lambda x, y, m: psi.psi_scores(model, _f32(weights), x, y, m).scores)
  np.testing.assert_allclose(fn(x, y, masks).numpy(),
                             _fd_scores(weights, x, y, masks), rtol=2e-4)


def _while_loops(graph_def) -> dict[str, int]:
  """{name: parallel_iterations} of every while loop in `graph_def`, its
  functions' bodies included."""
  nodes = list(graph_def.node) + [n for f in graph_def.library.function
                                  for n in f.node_def]
  return {n.name: n.attr["parallel_iterations"].i for n in nodes
          if n.op in ("While", "StatelessWhile")}


def test_forward_mode_maps_samples_and_chunks_one_at_a_time(setup):
  # in a graph tf.map_fn runs 10 iterations at once by default: the JVP
  # chunks of 10 samples held in memory together
  model, weights, x, y, masks = setup
  fn = tf.function(lambda x, y, m: psi.psi_scores(model, _f32(weights), x, y, m).scores)
  loops = _while_loops(fn.get_concrete_function(x, y, masks).graph.as_graph_def())
  maps = {name: n for name, n in loops.items() if name.endswith("map/while")}
  assert len(maps) == 2, loops  # over the samples, and over a sample's chunks
  assert set(maps.values()) == {1}, maps


@pytest.mark.parametrize("pixels, chunk, width", [
    (2, 64, 2 * C),  # the estimator's pixels, times the channels
    (None, 64, H * W * C),  # every pixel of the image at most
])
def test_no_chunk_of_jvps_is_wider_than_a_samples_jvps(setup, monkeypatch,
                                                       pixels, chunk, width):
  """A padded JVP costs as much as a real one. (That narrower chunks give
  the same scores: the finite-difference tests at chunks 1, 3 and 64.)"""
  model, weights, x, y, masks = setup
  widths, vectorized_map = [], tf.vectorized_map

  def spy(fn, elems, **kwargs):
    widths.append(elems.shape[0])
    return vectorized_map(fn, elems, **kwargs)

  monkeypatch.setattr(tf, "vectorized_map", spy)
  psi.psi_scores(model, _f32(weights), x[:1], y[:1], masks[:1], pixels=pixels,
                 chunk=chunk, seed=(3, 4))
  assert set(widths) == {width}


def test_estimator_is_unbiased_and_its_standard_error_is_honest(setup):
  model, weights, x, y, masks = setup
  region = masks[:1].copy()
  region[0] = True  # all 20 pixels
  exact = _fd_scores(weights, x[:1], y[:1], region)[0]
  estimate = tf.function(lambda seed: psi.psi_scores(
      model, _f32(weights), x[:1], y[:1], region, pixels=5, seed=seed))
  draws = [estimate(tf.constant([s, 7], tf.int64)) for s in range(300)]
  estimates = np.stack([d.scores.numpy()[0] for d in draws])
  errors = np.stack([d.standard_error.numpy()[0] for d in draws])
  # the mean of 300 draws lies within 4 standard errors of that mean
  spread = estimates.std(0) / np.sqrt(len(draws))
  assert np.all(np.abs(estimates.mean(0) - exact) < 4 * spread + 1e-9)
  # the reported standard error matches the spread of the estimates
  np.testing.assert_allclose(np.sqrt(np.mean(errors ** 2, 0)), estimates.std(0),
                             rtol=0.25)


@pytest.mark.slow
def test_estimator_with_every_pixel_is_exact(setup):
  model, weights, x, y, masks = setup
  got = psi.psi_scores(model, _f32(weights), x, y, masks, pixels=6)
  np.testing.assert_allclose(got.scores.numpy(), _fd_scores(weights, x, y, masks),
                             rtol=2e-4)
  assert not got.standard_error.numpy().any()


def test_bad_arguments_are_refused(setup):
  model, weights, x, y, masks = setup
  with pytest.raises(ValueError, match="pixels must be >= 2"):
    psi.psi_scores(model, _f32(weights), x, y, masks, pixels=1)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    psi.psi_scores(model, _f32(weights), x, y, masks, chunk=0)


def test_box_mask_is_the_union_of_half_open_boxes():
  mask = psi.box_mask([[1, 0, 3, 2], [0, 3, 1, 4]], 4, 4)
  expected = np.array([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("box, message", [
    ([0, 0, 5, 2], "x_max <= 4"), ([2, 0, 2, 1], "x_min < x_max"),
    ([0, 0, 1], "four integers"), (["a", 0, 1, 1], "four integers")])
def test_bad_boxes_are_refused_with_their_name(box, message):
  with pytest.raises(ValueError, match=r"boxes\[0\]=.*") as info:
    psi.box_mask([box], 3, 4)
  assert message in str(info.value)


def test_empty_or_misshapen_masks_are_refused():
  with pytest.raises(ValueError, match="selects no pixel"):
    psi.check_mask(np.zeros((2, 2)), 2, 2)
  with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
    psi.check_mask(np.ones((2, 3)), 2, 2)


def test_mean_by_format_averages_each_format():
  scores = np.array([[1.0, 2.0], [3.0, 4.0], [10.0, 20.0]])
  got = psi.mean_by_format(scores, ["receipt", "receipt", "invoice"])
  np.testing.assert_allclose(got["receipt"], [2.0, 3.0])
  np.testing.assert_allclose(got["invoice"], [10.0, 20.0])


# the nested tapes of a two-level U-Net's 14 tensors take a quarter of a
# minute; the fast suite checks the per-pixel loss on a one-level U-Net (its
# convolutions), the slow one also through pooling, upsampling and skips
@pytest.mark.parametrize("widths", [(2,), pytest.param((2, 3), marks=pytest.mark.slow)])
def test_segmentation_model_scores_agree_between_the_two_paths(widths):
  from tff_privacy.models import builders
  model = builders.unet((8, 8, 1), 2, seed=1, widths=widths)
  weights = [tf.constant(v) for v in model.trainable_variables]
  rng = np.random.default_rng(3)
  x = rng.random((1, 8, 8, 1)).astype(np.float32)
  y = (rng.random((1, 8, 8)) > 0.7).astype(np.int32)  # a per-pixel mask
  masks = psi.box_mask([[2, 2, 5, 4]], 8, 8)[None]
  reference = psi.psi_scores_nested_tape(model, weights, x, y, masks).numpy()
  fast = psi.psi_scores(model, weights, x, y, masks).scores.numpy()
  assert reference.shape == (1, len(weights)) and np.all(reference > 0)
  np.testing.assert_allclose(fast, reference, rtol=1e-4)


def test_box_text_is_parsed_and_partial_boxes_are_refused():
  assert psi.parse_boxes("0,0,1,1;2,2,3,3") == [[0, 0, 1, 1], [2, 2, 3, 3]]
  for text in ("1,2,3", "0,0,1,1;2", "", "a,b,c,d"):
    with pytest.raises(ValueError, match="expected 'x0,y0,x1,y1"):
      psi.parse_boxes(text, name="region")


@pytest.mark.slow
def test_grouped_scores_take_each_layers_norm_over_all_its_entries(setup):
  model, weights, x, y, masks = setup
  # layer 0: the hidden layer's kernel and bias; layer 1: the output's
  groups = psi.layer_groups(model)
  assert groups == [0, 0, 1, 1]
  got = psi.psi_scores(model, _f32(weights), x, y, masks, groups=groups).scores.numpy()
  expected = []
  for i in range(len(x)):
    squares = _fd_pixel_norms(weights, x[i], y[i]) ** 2
    layers = np.sqrt(np.stack([squares[0] + squares[1], squares[2] + squares[3]]))
    expected.append((layers * masks[i]).sum((1, 2)) / masks[i].sum())
  np.testing.assert_allclose(got, np.stack(expected), rtol=2e-4)


def test_layer_groups_skip_layers_without_weights_and_keep_bias_free_ones():
  inputs = tf.keras.Input((4,))
  hidden = tf.keras.layers.Dense(3, use_bias=False)(inputs)
  hidden = tf.keras.layers.Activation("relu")(hidden)
  outputs = tf.keras.layers.Dense(2)(hidden)
  assert psi.layer_groups(tf.keras.Model(inputs, outputs)) == [0, 1, 1]


@pytest.mark.parametrize("groups", [[0, 0, 1], [0, 0, 2, 2], [0, 1, 1, -1]])
def test_groups_that_miss_a_tensor_or_an_index_are_refused(setup, groups):
  model, weights, x, y, masks = setup
  with pytest.raises(ValueError, match="groups must give each of the 4 tensors"):
    psi.psi_scores(model, _f32(weights), x, y, masks, groups=groups)
