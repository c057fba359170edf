"""MovieLens 100K ratings as numpy splits for the example models.

A thin layer over ``model_garden.ranking.data.movielens``: the same files
(the installed ``recbole==1.2.1`` copy, or a directory), the same random
80/20 split (``movielens.split_indices``, seed 0, as ``movielens.datasets``
and the TFDS builder use), kept as numpy arrays so that the models can
batch, shuffle and score them however they need.

Example:
  >>> from model_garden.movielens import data
  >>> splits = data.load_splits()
  >>> len(splits.train["user_id"]), len(splits.test["user_id"])
  (80000, 20000)
  >>> splits.num_users, splits.num_movies
  (943, 1682)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import tensorflow as tf

from model_garden.ranking.data import movielens

#: The columns of a split: TensorFlow Datasets' ``movielens/100k-ratings``
#: names (``user_id``, ``movie_id``: int64 indices; ``user_rating``: stars
#: 1-5, float32) and ``rating``, the models' label ``(stars - 1) / 4``.
COLUMNS = ("user_id", "movie_id", "user_rating", "rating")


@dataclasses.dataclass(frozen=True)
class Splits:
  """The train and test ratings, one array per column of ``COLUMNS``.

  Attributes:
    train: ``{"user_id": int64, "movie_id": int64, "user_rating": float32
      (stars), "rating": float32 (in [0, 1])}`` (``COLUMNS``).
    test: the same for the test split.
    num_users: rows of the user table (943).
    num_movies: rows of the movie table (1682).
  """

  train: dict[str, np.ndarray]
  test: dict[str, np.ndarray]
  num_users: int
  num_movies: int


@functools.lru_cache(maxsize=4)
def load_splits(
  directory: str | None = None, test_fraction: float = 0.2, seed: int = 0
) -> Splits:
  """Reads MovieLens 100K and splits its ratings at random.

  Cached: the files are parsed once per process and arguments, and the
  same arrays are returned each time (do not modify them in place).

  Args:
    directory: the ``ml-100k`` files (default: the installed recbole's).
    test_fraction: share of the ratings in the test split.
    seed: the split's seed (``movielens.split_indices``).

  Returns:
    ``Splits`` with ratings scaled to ``[0, 1]`` (``(stars - 1) / 4``).

  Example:
    >>> from model_garden.movielens import data
    >>> float(data.load_splits().train["rating"].max())
    1.0
  """
  ml = movielens.load(directory)
  train, test = movielens.split_indices(len(ml), test_fraction, seed)

  def columns(indices: np.ndarray) -> dict[str, np.ndarray]:
    return {
      "user_id": ml.ratings["user_id"][indices].astype(np.int64),
      "movie_id": ml.ratings["movie_id"][indices].astype(np.int64),
      "user_rating": ml.ratings["raw_rating"][indices].astype(np.float32),
      "rating": ml.ratings["rating"][indices].astype(np.float32),
    }

  return Splits(columns(train), columns(test), ml.num_users, ml.num_movies)


def rating_dataset(
  split: dict[str, np.ndarray],
  batch_size: int,
  *,
  shuffle_seed: int | None = None,
) -> tf.data.Dataset:
  """``({"user_id", "movie_id"}, rating)`` batches for ``model.fit``.

  Args:
    split: ``Splits.train`` or ``Splits.test``.
    batch_size: examples per batch (the last batch may be smaller).
    shuffle_seed: shuffle all examples each epoch with this seed; None
      keeps the file order (for evaluation).

  Returns:
    A batched, prefetched ``tf.data.Dataset``.

  Example:
    >>> from model_garden.movielens import data
    >>> ds = data.rating_dataset(data.load_splits().test, 256)
    >>> features, rating = next(iter(ds))
    >>> sorted(features), rating.shape.as_list()
    (['movie_id', 'user_id'], [256])
  """
  features = {"user_id": split["user_id"], "movie_id": split["movie_id"]}
  ds = tf.data.Dataset.from_tensor_slices((features, split["rating"]))
  if shuffle_seed is not None:
    ds = ds.shuffle(len(split["rating"]), seed=shuffle_seed)
  return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def scaled_rating(user_rating: tf.Tensor) -> tf.Tensor:
  """The models' label: stars 1-5 → ``(stars - 1) / 4`` in ``[0, 1]``."""
  return (tf.cast(user_rating, tf.float32) - 1.0) / 4.0


def from_tfds(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Examples of TFDS's ``movielens/100k-ratings`` as the models' inputs.

  TFDS's examples hold ``user_id`` and ``movie_id`` as the raw MovieLens
  ids (strings such as ``"138"``) and ``user_rating`` in stars; the models
  take table indices (raw id minus one for MovieLens 100K) and a rating in
  ``[0, 1]``. Integer ids are taken as raw ids too.

  Args:
    dataset: unbatched examples with at least those three features.

  Returns:
    ``({"user_id": int64, "movie_id": int64}, rating)`` examples.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.movielens import data
    >>> tfds_like = tf.data.Dataset.from_tensor_slices({
    ...   "user_id": ["138", "92"], "movie_id": ["357", "709"],
    ...   "user_rating": [4.0, 2.0], "timestamp": [0, 0]})
    >>> features, rating = next(iter(data.from_tfds(tfds_like)))
    >>> int(features["user_id"]), int(features["movie_id"]), float(rating)
    (137, 356, 0.75)
  """

  def index(raw: tf.Tensor) -> tf.Tensor:
    if raw.dtype == tf.string:
      raw = tf.strings.to_number(raw, tf.int64)
    return tf.cast(raw, tf.int64) - 1

  def convert(example: dict[str, tf.Tensor]) -> Any:
    features = {
      "user_id": index(example["user_id"]),
      "movie_id": index(example["movie_id"]),
    }
    return features, scaled_rating(example["user_rating"])

  return dataset.map(convert, num_parallel_calls=tf.data.AUTOTUNE)
