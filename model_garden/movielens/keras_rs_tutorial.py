"""The keras-rs SparseCore tutorial's MovieLens model, off TPU.

The model of keras-rs' "DistributedEmbedding using TPU SparseCore and
TensorFlow" tutorial, written as the tutorial writes it (keras-rs
``TableConfig`` and ``FeatureConfig``, a subclassed ``EmbeddingModel``,
``compile`` and ``fit`` under the strategy's scope) with one change:
``keras_rs.layers.DistributedEmbedding`` is
``tpu_embedding.layers.DistributedEmbedding``. On TPU keras-rs runs the
tables on SparseCore; here they train under ``MirroredStrategy`` (or any
strategy this package supports), the ``"sparsecore"`` tables row-sharded
over the replicas and trained by their own optimizer (Adam), the MLP by the
model's (Adagrad).

As in the tutorial: user and movie tables of dimension 32, their two
activations concatenated into an MLP 256-64-1, the mean squared error on
ratings scaled to ``[0, 1]`` (``(stars - 1) / 4``), batches of 256 per
replica (the last incomplete training batch dropped), 5 epochs, 80% of the
ratings to train and 20% to test. The data are the real MovieLens 100K
ratings of ``model_garden.movielens.data`` (its random 80/20 split; ids
are already dense indices, so the tables need no extra row 0). The test
RMSE is computed on the whole test split.

Needs keras-rs (``pip install keras-rs``; Python 3.11 or later) for its
config classes, imported when the configs are built.

Example:
  >>> from model_garden.movielens import keras_rs_tutorial
  >>> config = keras_rs_tutorial.TutorialConfig()
  >>> config.per_replica_batch_size, config.embedding_dim, config.epochs
  (256, 32, 5)
  >>> keras_rs_tutorial.global_batch_size(config, num_replicas=2)
  512
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from model_garden.movielens import data
from tpu_embedding.layers import DistributedEmbedding


@dataclasses.dataclass(frozen=True)
class TutorialConfig:
  """The tutorial's settings.

  Attributes:
    per_replica_batch_size: examples per replica and step (the tutorial's
      ``PER_REPLICA_BATCH_SIZE``).
    embedding_dim: width of both tables (``EMBEDDING_DIMENSION``).
    epochs: passes over the training ratings.
    table_optimizer: every table's ``TableConfig.optimizer``.
    dense_optimizer: the optimizer of ``model.compile`` (the MLP's).
    placement: every table's ``TableConfig.placement``.
    seed: ``keras.utils.set_random_seed`` before the model is built.
  """

  per_replica_batch_size: int = 256
  embedding_dim: int = 32
  epochs: int = 5
  table_optimizer: Any = "adam"
  dense_optimizer: Any = "adagrad"
  placement: str = "sparsecore"
  seed: int = 0


def global_batch_size(config: TutorialConfig, num_replicas: int) -> int:
  """The tutorial's ``BATCH_SIZE``: per-replica batch times replicas."""
  return config.per_replica_batch_size * num_replicas


def feature_configs(
  num_users: int,
  num_movies: int,
  batch_size: int,
  config: TutorialConfig | None = None,
) -> dict[str, Any]:
  """The tutorial's ``FEATURE_CONFIGS``, in keras-rs' classes.

  Args:
    num_users: rows of the user table.
    num_movies: rows of the movie table.
    batch_size: the global batch size of ``input_shape``/``output_shape``.
    config: the settings (default ``TutorialConfig()``).

  Returns:
    ``{"movie_id": keras_rs.layers.FeatureConfig, "user_id": ...}``.
  """
  import keras_rs

  config = config or TutorialConfig()
  dim = config.embedding_dim
  movie_table = keras_rs.layers.TableConfig(
    name="movie_table",
    vocabulary_size=num_movies,
    embedding_dim=dim,
    optimizer=config.table_optimizer,
    placement=config.placement,
  )
  user_table = keras_rs.layers.TableConfig(
    name="user_table",
    vocabulary_size=num_users,
    embedding_dim=dim,
    optimizer=config.table_optimizer,
    placement=config.placement,
  )
  return {
    "movie_id": keras_rs.layers.FeatureConfig(
      name="movie",
      table=movie_table,
      input_shape=(batch_size,),
      output_shape=(batch_size, dim),
    ),
    "user_id": keras_rs.layers.FeatureConfig(
      name="user",
      table=user_table,
      input_shape=(batch_size,),
      output_shape=(batch_size, dim),
    ),
  }


class EmbeddingModel(keras.Model):
  """The tutorial's model: ``DistributedEmbedding``, then an MLP.

  Attributes:
    embedding_layer: the ``tpu_embedding.layers.DistributedEmbedding``.
    ratings: the MLP 256-64-1 on the concatenated activations.
  """

  def __init__(self, feature_configs: Any):
    """Creates the embedding layer (and tables) and the MLP."""
    super().__init__()
    # The tutorial's only changed line: keras_rs.layers.DistributedEmbedding.
    self.embedding_layer = DistributedEmbedding(feature_configs=feature_configs)
    self.ratings = keras.Sequential(
      [
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
      ]
    )

  def call(self, features: dict[str, Any]) -> Any:
    """Predicted ratings ``[B, 1]`` of ``{"user_id", "movie_id"}`` ids."""
    embedding = self.embedding_layer(features)
    return self.ratings(
      keras.ops.concatenate(
        [embedding["user_id"], embedding["movie_id"]], axis=1
      )
    )


def rating_dataset(
  split: dict[str, np.ndarray], batch_size: int, drop_remainder: bool
) -> tf.data.Dataset:
  """``({"user_id", "movie_id"}, rating)`` batches, cached, as the tutorial.

  Example:
    >>> from model_garden.movielens import data, keras_rs_tutorial
    >>> ds = keras_rs_tutorial.rating_dataset(
    ...     data.load_splits().train, 512, drop_remainder=True)
    >>> int(ds.cardinality())  # 80,000 ratings, the last 128 dropped
    156
  """
  features = {"user_id": split["user_id"], "movie_id": split["movie_id"]}
  ds = tf.data.Dataset.from_tensor_slices((features, split["rating"]))
  return ds.batch(batch_size, drop_remainder=drop_remainder).cache()


@dataclasses.dataclass
class TutorialResult:
  """What ``train_and_evaluate`` returns.

  Attributes:
    model: the trained ``EmbeddingModel``.
    test_rmse: RMSE on the whole test split, ``[0, 1]`` scale.
    baseline_rmse: the test RMSE of predicting the mean training rating.
    history: ``model.fit``'s ``History.history``.
    num_replicas: replicas of the strategy it trained under.
    train_seconds: wall time of ``fit``.
  """

  model: EmbeddingModel
  test_rmse: float
  baseline_rmse: float
  history: dict[str, list[float]]
  num_replicas: int
  train_seconds: float


def train_and_evaluate(
  config: TutorialConfig | None = None,
  splits: data.Splits | None = None,
  strategy: tf.distribute.Strategy | None = None,
  *,
  verbose: int = 0,
) -> TutorialResult:
  """Builds, trains and evaluates the tutorial's model under ``strategy``.

  Args:
    config: the settings (default ``TutorialConfig()``).
    splits: the data (default ``data.load_splits()``).
    strategy: default: the current strategy.
    verbose: ``fit`` verbosity.

  Returns:
    A ``TutorialResult``.
  """
  config = config or TutorialConfig()
  splits = splits or data.load_splits()
  strategy = strategy or tf.distribute.get_strategy()
  replicas = strategy.num_replicas_in_sync
  batch_size = global_batch_size(config, replicas)
  train = rating_dataset(splits.train, batch_size, drop_remainder=True)
  test = rating_dataset(splits.test, batch_size, drop_remainder=False)
  keras.utils.set_random_seed(config.seed)
  with strategy.scope():
    model = EmbeddingModel(
      feature_configs(splits.num_users, splits.num_movies, batch_size, config)
    )
    model.compile(
      loss=keras.losses.MeanSquaredError(),
      metrics=[keras.metrics.RootMeanSquaredError()],
      optimizer=config.dense_optimizer,
    )
  start = time.perf_counter()
  with strategy.scope():
    history = model.fit(train, epochs=config.epochs, verbose=verbose)
  seconds = time.perf_counter() - start
  with strategy.scope():
    metrics = model.evaluate(test, return_dict=True, verbose=0)
  mean = float(np.mean(splits.train["rating"]))
  baseline = float(np.sqrt(np.mean((splits.test["rating"] - mean) ** 2)))
  return TutorialResult(
    model=model,
    test_rmse=float(metrics["root_mean_squared_error"]),
    baseline_rmse=baseline,
    history=history.history,
    num_replicas=replicas,
    train_seconds=seconds,
  )
