"""MovieLens 100K rating prediction with ``tpu_embedding.layers.TPUEmbedding``.

The model of the Keras-RS SparseCore tutorial ("DistributedEmbedding using
TPU SparseCore", itself the Keras-RS basic ranking model): a user table and
a movie table of dimension 32, looked up by the Keras layer and trained by
their own optimizer (Adam, the tables' ``"adam"``), then an MLP
256-64-1 on the two concatenated embeddings, trained by the model's Keras
optimizer (Adagrad). The label is the rating scaled to ``[0, 1]``, the loss
the mean squared error, the figure the test RMSE on a random 20% of the
ratings.

With the defaults (batch 256, 5 epochs, about 10 s on two CPU cores) the
test RMSE is about 0.236 (0.94 stars); a constant prediction of the mean
rating scores about 0.28.

The model is split in two Keras models so that it can be served:
``RankingModel.embedding`` (the tables) and ``RankingModel.head`` (the
MLP, from activations to a rating). ``export`` writes a SavedModel from
raw ids to ratings with ``tpu_embedding.export.export_for_serving``.

Example:
  >>> from model_garden.movielens import ranking
  >>> model = ranking.build_model(943, 1682)
  >>> sorted(t.name for t in model.embedding.embedding_tables)
  ['movie_table', 'user_table']
  >>> [layer.units for layer in model.head.layers if hasattr(layer, "units")]
  [256, 64, 1]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.movielens import data
from model_garden.movielens import run_dir
from tpu_embedding import export as tpe_export
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.row_storage import FLOAT32

#: The id features, in the order the head concatenates their activations.
FEATURES = ("user_id", "movie_id")


@dataclasses.dataclass(frozen=True)
class RankingConfig:
  """Hyper-parameters of the ranking example (the tutorial's by default).

  Attributes:
    embedding_dim: width of the user and movie tables.
    mlp_units: the hidden layers of the head (a final ``Dense(1)`` follows).
    embedding_optimizer: the tables' optimizer: a name the layer accepts
      (``"adam"``: ``tpe.Adam(0.001)``) or a ``tpu_embedding`` optimizer.
    dense_optimizer: the Keras optimizer of the head (name or instance).
    batch_size: training and evaluation batch.
    epochs: passes over the 80,000 training ratings.
    seed: seeds the initializers (``keras.utils.set_random_seed``) and the
      per-epoch shuffling.
    split_seed: seed of the 80/20 split.
    test_fraction: share of the ratings held out.
    storage: how both tables store their rows (``tpe.RowStorage``:
      float32 by default; bfloat16 or float16 rows keep float32 math and
      Adam's float32 slots).
  """

  embedding_dim: int = 32
  mlp_units: tuple[int, ...] = (256, 64)
  embedding_optimizer: Any = "adam"
  dense_optimizer: Any = "adagrad"
  batch_size: int = 256
  epochs: int = 5
  seed: int = 0
  split_seed: int = 0
  test_fraction: float = 0.2
  storage: tpe.RowStorage = FLOAT32


class RankingModel(keras.Model):
  """Ids → embeddings (``TPUEmbedding``) → MLP → rating in about ``[0, 1]``.

  Called on ``{"user_id": ids, "movie_id": ids}`` (int, shape ``[B]``), it
  returns ``[B, 1]`` predicted ratings. ``model.fit`` trains the tables with
  their own optimizer through the layer's gradient hook and the head with
  the optimizer given to ``compile``.

  Attributes:
    feature_config: ``{"user_id": FeatureConfig, "movie_id": ...}``.
    embedding: the ``tpu_embedding.layers.TPUEmbedding`` layer.
    head: a functional Keras model ``{"user_id": [B, dim], "movie_id":
      [B, dim]}`` → ``[B, 1]``.

  Example:
    >>> import numpy as np
    >>> from model_garden.movielens.ranking import RankingModel
    >>> model = RankingModel(num_users=10, num_movies=20, embedding_dim=4,
    ...                      mlp_units=(8,))
    >>> model({"user_id": np.array([1, 2]),
    ...        "movie_id": np.array([3, 4])}).shape
    TensorShape([2, 1])
  """

  def __init__(
    self,
    num_users: int,
    num_movies: int,
    embedding_dim: int = 32,
    mlp_units: tuple[int, ...] = (256, 64),
    embedding_optimizer: Any = "adam",
    storage: tpe.RowStorage = FLOAT32,
    **kwargs: Any,
  ):
    """Creates the tables and the head.

    Args:
      num_users: rows of the user table.
      num_movies: rows of the movie table.
      embedding_dim: width of both tables.
      mlp_units: hidden layers of the head, ReLU; a linear ``Dense(1)``
        follows.
      embedding_optimizer: the tables' optimizer (see ``RankingConfig``).
      storage: how the tables store their rows (``RankingConfig``).
      **kwargs: ``keras.Model`` arguments (``name``).
    """
    super().__init__(**kwargs)
    user_table = tpe.TableConfig(
      vocabulary_size=num_users,
      dim=embedding_dim,
      name="user_table",
      storage=storage,
    )
    movie_table = tpe.TableConfig(
      vocabulary_size=num_movies,
      dim=embedding_dim,
      name="movie_table",
      storage=storage,
    )
    self.feature_config = {
      "user_id": tpe.FeatureConfig(user_table, name="user"),
      "movie_id": tpe.FeatureConfig(movie_table, name="movie"),
    }
    self.embedding = TPUEmbedding(
      self.feature_config, embedding_optimizer, name="embedding"
    )
    self.head = rating_head(embedding_dim, mlp_units)

  def call(self, features: dict[str, tf.Tensor], training: Any = None):
    """Predicted ratings ``[B, 1]`` for ``{"user_id", "movie_id"}`` ids."""
    ids = {name: features[name] for name in FEATURES}
    activations = self.embedding(ids, training=training)
    # A plain dict: the head's functional model checks the input type.
    activations = {name: activations[name] for name in FEATURES}
    return self.head(activations, training=training)


def rating_head(embedding_dim: int, mlp_units: tuple[int, ...]) -> keras.Model:
  """The MLP from the two activations to a rating, as a functional model.

  Args:
    embedding_dim: width of each activation.
    mlp_units: hidden ReLU layers; a linear ``Dense(1)`` follows.

  Returns:
    A Keras model ``{"user_id": [B, dim], "movie_id": [B, dim]}`` →
    ``[B, 1]`` (named inputs, so that ``export_for_serving`` can feed it).

  Example:
    >>> from model_garden.movielens.ranking import rating_head
    >>> rating_head(32, (256, 64)).count_params()
    33153
  """
  # Keys in sorted order, as tf.nest flattens dicts (no Keras warning).
  inputs = {
    name: keras.Input(shape=(embedding_dim,), name=name)
    for name in sorted(FEATURES)
  }
  x = keras.layers.Concatenate()([inputs[name] for name in FEATURES])
  for units in mlp_units:
    x = keras.layers.Dense(units, activation="relu")(x)
  rating = keras.layers.Dense(1, name="rating")(x)
  return keras.Model(inputs, rating, name="rating_head")


def build_model(
  num_users: int, num_movies: int, config: RankingConfig | None = None
) -> RankingModel:
  """A compiled ``RankingModel`` (MSE loss, RMSE metric).

  Args:
    num_users: rows of the user table.
    num_movies: rows of the movie table.
    config: hyper-parameters (default ``RankingConfig()``).

  Returns:
    The model, compiled with ``config.dense_optimizer`` for the head.
  """
  config = config or RankingConfig()
  model = RankingModel(
    num_users,
    num_movies,
    config.embedding_dim,
    config.mlp_units,
    config.embedding_optimizer,
    config.storage,
    name="movielens_ranking",
  )
  model.compile(
    optimizer=config.dense_optimizer,
    loss=keras.losses.MeanSquaredError(),
    metrics=[keras.metrics.RootMeanSquaredError(name="rmse")],
  )
  return model


@dataclasses.dataclass
class RankingResult:
  """What ``train_and_evaluate`` returns.

  Attributes:
    model: the trained ``RankingModel``.
    test_rmse: RMSE on the test split, on the ``[0, 1]`` scale (multiply
      by 4 for stars).
    train_rmse: the last epoch's running training RMSE.
    test_rmse_per_epoch: the test RMSE after each epoch.
    baseline_rmse: the test RMSE of always predicting the mean training
      rating.
    epochs: epochs trained.
    train_seconds: wall time of the ``fit`` calls.
  """

  model: RankingModel
  test_rmse: float
  train_rmse: float
  test_rmse_per_epoch: list[float]
  baseline_rmse: float
  epochs: int
  train_seconds: float


def train_and_evaluate(
  config: RankingConfig | None = None,
  splits: data.Splits | None = None,
  *,
  verbose: int = 0,
  model_dir: str | None = None,
) -> RankingResult:
  """Trains the ranking model on MovieLens 100K and reports the test RMSE.

  Args:
    config: hyper-parameters (default ``RankingConfig()``).
    splits: the data (default ``data.load_splits`` with the config's split).
    verbose: ``model.fit`` verbosity (1: a progress bar, 2: a line per
      epoch); with ``verbose > 0`` the test figures of each epoch are
      printed too.
    model_dir: checkpoints every epoch, resumes from the latest, writes
      TensorBoard summaries (``run_dir.RunDirectory``); None: none.

  Returns:
    A ``RankingResult``.

  Example:
    >>> from model_garden.movielens import ranking
    >>> result = ranking.train_and_evaluate(ranking.RankingConfig(epochs=1))
    >>> 0.2 < result.test_rmse < result.baseline_rmse
    True
  """
  config = config or RankingConfig()
  splits = splits or data.load_splits(
    test_fraction=config.test_fraction, seed=config.split_seed
  )
  keras.utils.set_random_seed(config.seed)
  model = build_model(splits.num_users, splits.num_movies, config)
  test = data.rating_dataset(splits.test, config.batch_size)
  per_epoch = []
  train_rmse = float("nan")
  seconds = 0.0
  run, first_epoch = None, 0
  if model_dir:
    run_dir.build(model, next(iter(test))[0])
    run = run_dir.RunDirectory(model_dir, model)
    first_epoch = run.epochs_done
    if verbose and run.restored:
      print(f"restored {run.restored} ({first_epoch} epochs done)")
  for epoch in range(first_epoch, config.epochs):
    train = data.rating_dataset(
      splits.train, config.batch_size, shuffle_seed=config.seed + epoch
    )
    start = time.perf_counter()
    history = model.fit(train, epochs=1, verbose=verbose, shuffle=False)
    seconds += time.perf_counter() - start
    train_rmse = float(history.history["rmse"][-1])
    per_epoch.append(evaluate_rmse(model, test))
    if run is not None:
      run.end_epoch(
        epoch + 1,
        {"loss": float(history.history["loss"][-1]), "rmse": train_rmse},
        {"rmse": per_epoch[-1]},
      )
    if verbose:
      print(
        f"epoch {epoch + 1}/{config.epochs}: train RMSE {train_rmse:.4f}, "
        f"test RMSE {per_epoch[-1]:.4f} ({seconds:.1f} s)"
      )
  mean = float(np.mean(splits.train["rating"]))
  baseline = float(np.sqrt(np.mean((splits.test["rating"] - mean) ** 2)))
  return RankingResult(
    model=model,
    test_rmse=per_epoch[-1] if per_epoch else evaluate_rmse(model, test),
    train_rmse=train_rmse,
    test_rmse_per_epoch=per_epoch,
    baseline_rmse=baseline,
    epochs=config.epochs,
    train_seconds=seconds,
  )


def evaluate_rmse(model: keras.Model, dataset: tf.data.Dataset) -> float:
  """The RMSE of ``model`` over every example of ``dataset``.

  Computed from ``model.predict`` (which never updates a table), so it
  does not depend on the compiled metrics.

  Args:
    model: maps the dataset's features to ``[B, 1]`` ratings.
    dataset: ``(features, rating)`` batches.

  Returns:
    ``sqrt(mean((prediction - rating)^2))``.
  """
  predictions = model.predict(dataset.map(lambda x, y: x), verbose=0)
  labels = np.concatenate([y.numpy() for _, y in dataset])
  return float(np.sqrt(np.mean((predictions[:, 0] - labels) ** 2)))


def export(model: RankingModel, export_dir: str) -> tpe_export.ExportResult:
  """Writes a SavedModel serving ratings from raw user and movie ids.

  Its ``serving_default`` signature takes ``user_id`` and ``movie_id``
  (int64, ``[B]``) and returns ``predictions`` (``[B, 1]``); it holds the
  two tables and the head's weights only (no optimizer slots) and loads
  with TensorFlow alone.

  Args:
    model: a trained ``RankingModel``.
    export_dir: where to write.

  Returns:
    ``tpu_embedding.export.ExportResult``.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> from model_garden.movielens import ranking
    >>> model = ranking.RankingModel(10, 20, 4, (8,))
    >>> result = ranking.export(model, tempfile.mkdtemp())
    >>> serve = tf.saved_model.load(result.export_dir).signatures[
    ...     "serving_default"]
    >>> serve(user_id=tf.constant([1, 2], tf.int64),
    ...       movie_id=tf.constant([3, 4], tf.int64))["predictions"].shape
    TensorShape([2, 1])
  """
  return tpe_export.export_for_serving(
    export_dir,
    model.embedding.mid_level_api,
    model.head,
    {name: tpe_export.FeatureSpec([None]) for name in FEATURES},
    feature_config=model.feature_config,
  )
