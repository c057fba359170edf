"""Ranking models: layers against numpy, shapes, Model Garden's configs.

The interactions are checked against direct numpy formulas on small
inputs; the experiment configs against the numbers Model Garden publishes
(``official/recommendation/ranking/configs/config.py``,
``configs/yaml/*.yaml``) and its ``WarmUpAndPolyDecay`` schedule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import configs
from model_garden.ranking import embedding
from model_garden.ranking import lr_schedule
from model_garden.ranking import model as ranking_model
from model_garden.ranking import optimizers
from model_garden.ranking.configs import definitions
from model_garden.ranking.layers import CrossNetwork
from model_garden.ranking.layers import DotInteraction
from tpu_embedding.planning import Planner
from tpu_embedding.sharding import PlacementPolicy

CRITEO_VOCAB_SIZES = [
  39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
  2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
  39664984, 585935, 12972, 108, 36,
]  # fmt: skip
MLPERF_MULTI_HOT_SIZES = [
  3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10,
  3, 1, 1,
]  # fmt: skip


def random_features(rng, num_features, batch=3, dim=4):
  return [
    rng.normal(size=(batch, dim)).astype(np.float32)
    for _ in range(num_features)
  ]


# --- interactions vs numpy ---------------------------------------------------


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_is_the_lower_triangle_of_pairwise_dots(
  rng, self_interaction
):
  features = random_features(rng, 4)
  got = DotInteraction(self_interaction=self_interaction)(features)
  want = [
    [
      float(features[i][b] @ features[j][b])
      for i in range(4)
      for j in range(4)
      if (j <= i if self_interaction else j < i)
    ]
    for b in range(3)
  ]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_dot_interaction_skip_gather_zeroes_the_upper_triangle(rng):
  features = random_features(rng, 3)
  got = np.asarray(DotInteraction(skip_gather=True)(features))
  stacked = np.stack(features, axis=1)
  gram = np.einsum("bfd,bgd->bfg", stacked, stacked)
  want = (gram * np.tril(np.ones((3, 3)), k=-1)).reshape(3, 9)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dot_interaction_rejects_mixed_widths():
  with pytest.raises(ValueError, match="one width"):
    DotInteraction()([np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)])


def dense_weights(layer):
  weights = [np.asarray(w) for w in layer.weights]
  return weights[0], weights[1] if len(weights) > 1 else 0.0


def test_full_rank_cross_layer_matches_the_dcn_v2_formula(rng):
  x0 = rng.normal(size=(5, 6)).astype(np.float32)
  cross = CrossNetwork(num_layers=1, bias_initializer="random_normal")
  got = np.asarray(cross(x0))
  kernel, bias = dense_weights(cross.kernels[0])
  want = x0 * (x0 @ kernel + bias) + x0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_low_rank_cross_network_matches_the_stacked_formula(rng):
  x0 = rng.normal(size=(5, 8)).astype(np.float32)
  cross = CrossNetwork(
    num_layers=3, projection_dim=2, bias_initializer="random_normal"
  )
  got = np.asarray(cross(x0))
  x = x0
  for u_layer, v_layer in zip(cross.projections, cross.kernels, strict=True):
    u, _ = dense_weights(u_layer)
    v, b = dense_weights(v_layer)
    assert u.shape == (8, 2) and v.shape == (2, 8)
    x = x0 * ((x @ u) @ v + b) + x
  np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-5)


def test_cross_network_concatenates_a_list_of_inputs(rng):
  parts = random_features(rng, 3, dim=2)
  cross = CrossNetwork()
  concatenated = np.concatenate(parts, axis=1)
  np.testing.assert_allclose(
    cross(parts), cross(concatenated), rtol=1e-6, atol=1e-6
  )


# --- the models -----------------------------------------------------------


@pytest.mark.parametrize(
  "experiment",
  [
    "dlrm_criteo_cpu_small",
    "dcn_criteo_cpu_small",
    "dlrm_dcn_v2_criteo_cpu_small",
  ],
)
def test_models_map_features_to_one_logit_per_example(experiment):
  config = configs.get_config(experiment).task.model
  model = ranking_model.build_model(config)
  logits = model(ranking_model.example_inputs(config, batch_size=3))
  assert tuple(logits.shape) == (3,)
  top_input = model.top_mlp.dense_layers[0].kernel.shape[0]
  features = len(config.vocab_sizes) + 1
  dim = config.embedding_dim
  bottom = config.bottom_mlp[-1]
  if config.interaction == "dot":  # skip_gather: the F x F matrix
    assert top_input == bottom + features * features
  elif config.interaction == "cross":  # concat_dense
    assert top_input == bottom + features * dim
  else:  # multi_layer_dcn without concat_dense
    assert top_input == features * dim


@pytest.mark.parametrize(
  "experiment",
  [
    "dlrm_criteo_cpu_small",
    "dcn_criteo_cpu_small",
    "dlrm_dcn_v2_criteo_cpu_small",
  ],
)
def test_checkpoints_hold_every_dense_weight(experiment, tmp_path):
  config = configs.get_config(experiment).task.model
  inputs = ranking_model.example_inputs(config, batch_size=2)
  trained, fresh = (ranking_model.build_model(config) for _ in range(2))
  trained(inputs), fresh(inputs)
  path = tf.train.Checkpoint(model=trained).save(str(tmp_path / "ckpt"))
  tf.train.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert len(fresh.weights) == len(trained.weights) > 0
  for got, want in zip(fresh.weights, trained.weights, strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dlrm_model_equals_its_formula(rng):
  config = definitions.ModelConfig(
    vocab_sizes=(5, 5), embedding_dim=2, bottom_mlp=(2,), top_mlp=(1,)
  )
  model = ranking_model.build_model(config)
  dense = rng.normal(size=(4, 13)).astype(np.float32)
  embeddings = random_features(rng, 2, batch=4, dim=2)
  got = np.asarray(model({"dense_features": dense, "embeddings": embeddings}))
  bottom_w, bottom_b = dense_weights(model.bottom_mlp.dense_layers[0])
  top_w, top_b = dense_weights(model.top_mlp.dense_layers[0])
  d = np.maximum(dense @ bottom_w + bottom_b, 0)
  vectors = embeddings + [d]
  gram = np.einsum("bfd,bgd->bfg", np.stack(vectors, 1), np.stack(vectors, 1))
  interaction = (gram * np.tril(np.ones((3, 3)), k=-1)).reshape(4, 9)
  want = (np.concatenate([d, interaction], 1) @ top_w + top_b)[:, 0]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_feature_config_is_model_gardens():
  config = configs.get_config("dlrm_criteo").task.model
  features = embedding.feature_config(config)
  assert list(features) == [str(i) for i in range(26)]
  table = features["9"].table
  assert table.name == "embedding_table_09"
  assert (table.vocabulary_size, table.dim) == (38532951, 64)
  assert table.combiner == "mean"
  assert math.isclose(table.initializer.stddev, 1 / 8)


def test_cpu_small_tables_are_partly_row_sharded_over_two_replicas():
  config = configs.get_config("dlrm_criteo_cpu_small").task.model
  tables = [f.table for f in embedding.feature_config(config).values()]
  policy = PlacementPolicy(config.row_sharding_threshold())
  plan = Planner(2).plan(tables, policy, None).tables
  kinds = [p.kind for p in plan.placements.values()]
  assert 0 < kinds.count("row_sharded") < len(kinds)
  multi_hot = configs.get_config("dlrm_dcn_v2_criteo_cpu_small").task.model
  assert multi_hot.row_sharding_threshold() == 0  # every table sharded


# --- Model Garden's published configs ----------------------------------------


def test_dlrm_criteo_is_model_gardens():
  config = configs.get_config("dlrm_criteo")
  model = config.task.model
  assert list(model.vocab_sizes) == CRITEO_VOCAB_SIZES
  assert model.num_dense_features == 13
  assert model.embedding_dim == 64
  assert list(model.bottom_mlp) == [512, 256, 64]
  assert list(model.top_mlp) == [1024, 1024, 512, 256, 1]
  assert model.interaction == "dot" and model.concat_dense
  assert model.size_threshold == 50_000
  assert config.task.train_data.global_batch_size == 16384
  assert config.task.validation_data.global_batch_size == 16384
  trainer = config.trainer
  assert trainer.train_steps == 4195197692 // 16384 == 256054
  assert trainer.validation_interval == 256054 // 2
  assert trainer.validation_steps == 89137318 // 16384 == 5440
  opt = trainer.optimizer_config
  assert (opt.embedding_optimizer, opt.dense_optimizer) == ("SGD", "Adam")
  lr = opt.lr_config
  assert (
    lr.learning_rate,
    lr.warmup_steps,
    lr.decay_steps,
    lr.decay_start_steps,
    lr.decay_exp,
  ) == (1.25, 8000, 30000, 70000, 2)
  assert opt.dense_sgd_config.warmup_steps == 0


def test_dcn_criteo_is_model_gardens():
  dlrm = configs.get_config("dlrm_criteo")
  dcn = configs.get_config("dcn_criteo")
  assert dcn.task.model.interaction == "cross"
  assert dcn.task.model.embedding_dim == 64
  assert dcn.task.model.bottom_mlp == dlrm.task.model.bottom_mlp
  assert dcn.task.model.top_mlp == dlrm.task.model.top_mlp
  assert dcn.trainer == dlrm.trainer


def test_dlrm_dcn_v2_criteo_is_model_gardens():
  config = configs.get_config("dlrm_dcn_v2_criteo")
  model = config.task.model
  assert model.interaction == "multi_layer_dcn"
  assert (model.dcn_num_layers, model.dcn_low_rank_dim) == (3, 512)
  assert model.dcn_use_bias and not model.concat_dense
  assert model.use_multi_hot
  assert list(model.multi_hot_sizes) == MLPERF_MULTI_HOT_SIZES
  assert not model.use_partial_tpu_embedding
  assert list(model.bottom_mlp) == [512, 256, 64]
  assert model.embedding_dim == 64
  assert list(model.top_mlp) == [1024, 1024, 512, 256, 1]
  assert model.dcn_kernel_initializer == "truncated_normal"
  assert model.dcn_bias_initializer == "zeros"


def test_every_experiment_validates():
  for name in configs.experiments():
    configs.validate(configs.get_config(name))
  assert {
    "dlrm_criteo",
    "dcn_criteo",
    "dlrm_dcn_v2_criteo",
    "dlrm_criteo_cpu_small",
    "dcn_criteo_cpu_small",
    "dlrm_dcn_v2_criteo_cpu_small",
  } <= set(configs.experiments())


def test_validation_names_the_field_and_the_fix():
  config = configs.get_config("dlrm_criteo_cpu_small")
  bad = configs.override(config, {"task.model.embedding_dim": 8})
  with pytest.raises(ValueError, match="bottom MLP's last layer"):
    configs.validate(bad)
  with pytest.raises(ValueError, match="Unknown config key 'task.model.foo'"):
    configs.override(config, {"task": {"model": {"foo": 1}}})
  with pytest.raises(ValueError, match="expected an integer"):
    configs.override(config, {"trainer.train_steps": "many"})


def test_params_override_and_config_files_apply_in_order(tmp_path):
  path = tmp_path / "override.yaml"
  path.write_text('{"trainer": {"train_steps": 5, "max_to_keep": 2}}')
  config = configs.override(
    configs.get_config("dcn_criteo"), configs.load_yaml(str(path))
  )
  config = configs.override(
    config,
    configs.parse_params_override(
      "trainer.train_steps=7,task.model.bottom_mlp=[32, 64],"
      "task.use_synthetic_data=true,trainer.optimizer_config."
      "embedding_optimizer=Adagrad"
    ),
  )
  assert config.trainer.train_steps == 7
  assert config.trainer.max_to_keep == 2
  assert config.task.model.bottom_mlp == (32, 64)
  assert config.task.use_synthetic_data is True
  assert config.trainer.optimizer_config.embedding_optimizer == "Adagrad"


def test_model_garden_yaml_files_apply():
  import yaml  # a dependency of the package

  text = """
runtime:
  distribution_strategy: 'tpu'
task:
  model:
    bottom_mlp: [512, 256, 64]
    embedding_dim: 64
    interaction: 'dot'
  train_data:
    global_batch_size: 16384
    input_path: path_to_training_data_dir/*
    num_shards_per_host: 4
trainer:
  checkpoint_interval: 85352
  eval_tf_while_loop: false
  train_steps: 256054
  validation_summary_subdir: 'validation'
"""
  config = configs.override(
    configs.get_config("dlrm_criteo"), yaml.safe_load(text)
  )
  assert config.runtime.distribution_strategy == "tpu"
  assert config.trainer.checkpoint_interval == 85352


# --- learning rates -------------------------------------------------------


def model_garden_rate(step, batch, lr, warmup, decay, start, exp):
  """WarmUpAndPolyDecay as written in Model Garden's ranking/common.py."""
  adj = lr * batch / 2048
  if warmup == 0:
    return adj
  if step < warmup:
    rate = step / warmup * adj
  elif decay > 0 and step > start:
    done = min(step - start, decay)
    rate = max(0.0001, adj * ((decay - done) / decay) ** exp)
  else:
    rate = adj
  return max(0.01, rate)


@pytest.mark.parametrize("batch", [2048, 16384, 512])
def test_warmup_and_poly_decay_matches_model_garden(batch):
  args = dict(lr=1.25, warmup=8000, decay=30000, start=70000, exp=2.0)
  schedule = lr_schedule.WarmUpAndPolyDecay(
    batch_size=batch,
    learning_rate=args["lr"],
    warmup_steps=args["warmup"],
    decay_steps=args["decay"],
    decay_start_steps=args["start"],
    decay_exp=args["exp"],
  )
  for step in [0, 1, 3999, 7999, 8000, 50000, 70000, 70001, 85000, 99999,
               100000, 150000]:  # fmt: skip
    want = model_garden_rate(step, batch, **args)
    assert math.isclose(float(schedule(step)), want, rel_tol=1e-5), step


def test_schedule_without_warmup_is_constant_and_unfloored():
  schedule = lr_schedule.WarmUpAndPolyDecay(
    batch_size=1024, learning_rate=0.001, warmup_steps=0
  )
  rates = [float(schedule(s)) for s in (0, 10**6)]
  np.testing.assert_allclose(rates, [0.0005, 0.0005], rtol=1e-6)


def test_embedding_learning_rate_follows_the_step_variable():
  step = tf.Variable(0, dtype=tf.int64)
  opt = optimizers.embedding_optimizer(
    definitions.OptimizationConfig(
      embedding_optimizer="Adagrad",
      lr_config=definitions.LearningRateConfig(
        learning_rate=2.0, warmup_steps=10, decay_steps=0
      ),
    ),
    batch_size=4096,
    step=step,
  )
  assert isinstance(opt, tpe.Adagrad)
  rates = []
  for value in (0, 5, 10, 100):
    step.assign(value)
    rates.append(round(float(opt.learning_rate()), 4))
  assert rates == [0.01, 2.0, 4.0, 4.0]
  dense = optimizers.dense_optimizer(
    definitions.OptimizationConfig(dense_optimizer="SGD"), batch_size=4096
  )
  assert isinstance(dense._learning_rate, lr_schedule.WarmUpAndPolyDecay)
