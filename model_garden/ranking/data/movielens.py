"""MovieLens 100K, read from the copy an installed package ships.

The real MovieLens 100K ratings (100,000 ratings by 943 users of 1,682
movies) ship inside PyPI ``recbole==1.2.1`` (``pip install --no-deps
recbole==1.2.1``) as RecBole atomic files under
``recbole/dataset_example/ml-100k/``: ``ml-100k.inter`` (user, item,
rating, timestamp), ``ml-100k.user`` (age, gender, occupation, zip code)
and ``ml-100k.item`` (title, release year, genres). They are found without
importing recbole; any directory holding those files works too. The
MovieLens licence forbids redistribution: the data is read in place, never
copied into this repository.

Each example (one rating) is

=======================  =========  =====================================
key                      dtype      value
=======================  =========  =====================================
``user_id``              int32      user index in ``[0, 943)``
``movie_id``             int32      movie index in ``[0, 1682)``
``rating``               float32    ``(stars - 1) / 4``, in ``[0, 1]``
``raw_rating``           float32    stars, 1..5
``timestamp``            int64      seconds since 1970
``user_age``             int32      years
``user_gender``          int32      0 = F, 1 = M
``user_occupation``      int32      index into ``OCCUPATIONS``
``user_zip_code``        string     as written (not all numeric)
``movie_title``          string     RecBole's title (year removed)
``movie_release_year``   int32      0 when unknown (2 movies)
``movie_genres``         int32      ragged indices into ``GENRES``
=======================  =========  =====================================

The index of a user or movie is the rank of its raw id among the ids of
``.user`` / ``.item`` (for ML-100K, raw id minus one).

Example:
  >>> from model_garden.ranking.data import movielens
  >>> ml = movielens.load()
  >>> len(ml.ratings["user_id"]), ml.num_users, ml.num_movies
  (100000, 943, 1682)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import tensorflow as tf

FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
#: MovieLens 100K's genres, in its ``u.genre`` order.
GENRES = (
  "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy",
  "Crime", "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror",
  "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
#: MovieLens 100K's occupations (``u.occupation``).
OCCUPATIONS = (
  "administrator", "artist", "doctor", "educator", "engineer",
  "entertainment", "executive", "healthcare", "homemaker", "lawyer",
  "librarian", "marketing", "none", "other", "programmer", "retired",
  "salesman", "scientist", "student", "technician", "writer",
)  # fmt: skip
_HEADERS = {
  "ml-100k.inter": [
    "user_id:token", "item_id:token", "rating:float", "timestamp:float",
  ],
  "ml-100k.user": [
    "user_id:token", "age:token", "gender:token", "occupation:token",
    "zip_code:token",
  ],
  "ml-100k.item": [
    "item_id:token", "movie_title:token_seq", "release_year:token",
    "class:token_seq",
  ],
}  # fmt: skip


def find_data_dir() -> str:
  """The ``ml-100k`` directory of the installed ``recbole`` package.

  Raises:
    FileNotFoundError: when recbole (with its example data) is missing.

  Example:
    >>> from model_garden.ranking.data import movielens
    >>> movielens.find_data_dir().endswith("ml-100k")
    True
  """
  spec = importlib.util.find_spec("recbole")
  roots = list(spec.submodule_search_locations or []) if spec else []
  for root in roots:
    path = os.path.join(root, "dataset_example", "ml-100k")
    if all(os.path.isfile(os.path.join(path, f)) for f in FILES):
      return path
  raise FileNotFoundError(
    "MovieLens 100K was not found; install it with "
    "`pip install --no-deps recbole==1.2.1` or pass the directory that "
    f"holds {', '.join(FILES)}."
  )


def _read_rows(path: str) -> list[list[str]]:
  """Tab-separated rows after the header, checked for width."""
  name = os.path.basename(path)
  with tf.io.gfile.GFile(path, "r") as f:
    header = f.readline().rstrip("\n").split("\t")
    if header != _HEADERS[name]:
      raise ValueError(f"{path}:1: unexpected header {header}.")
    rows = []
    for number, line in enumerate(f, start=2):
      row = line.rstrip("\n").split("\t")
      if len(row) != len(header):
        raise ValueError(
          f"{path}:{number}: expected {len(header)} fields, got {len(row)}."
        )
      rows.append(row)
  return rows


def _index(raw_ids: list[str], path: str) -> dict[str, int]:
  """Raw id → rank among the sorted integer ids."""
  ints = [int(i) for i in raw_ids]
  if len(set(ints)) != len(ints):
    raise ValueError(f"{path}: duplicate ids.")
  return {str(i): n for n, i in enumerate(sorted(ints))}


@dataclasses.dataclass(frozen=True)
class MovieLens100K:
  """The ratings, one numpy array per feature (see the module table).

  Attributes:
    ratings: feature name → array of 100,000 values (``movie_genres`` is an
      object array of int32 arrays).
    num_users: 943.
    num_movies: 1682.
    directory: where the files were read.
  """

  ratings: dict[str, object]
  num_users: int
  num_movies: int
  directory: str

  def __len__(self) -> int:
    return len(self.ratings["user_id"])


def load(directory: str | None = None) -> MovieLens100K:
  """Reads MovieLens 100K (ratings joined with user and movie features).

  Args:
    directory: holds ``ml-100k.inter``, ``.user`` and ``.item``; default
      the installed recbole's copy.

  Returns:
    ``MovieLens100K``, ratings in file order.

  Raises:
    FileNotFoundError: no data; ValueError: a malformed file (the message
      names the file and line).
  """
  directory = directory or find_data_dir()
  paths = [os.path.join(directory, f) for f in FILES]
  missing = [p for p in paths if not tf.io.gfile.exists(p)]
  if missing:
    raise FileNotFoundError(f"MovieLens 100K files not found: {missing}.")
  inter, users, items = (_read_rows(p) for p in paths)

  user_index = _index([u[0] for u in users], paths[1])
  movie_index = _index([m[0] for m in items], paths[2])
  user = _user_table(users, user_index, paths[1])
  movie = _movie_table(items, movie_index, paths[2])

  for line, (uid, mid, stars, _) in enumerate(inter, start=2):
    if uid not in user_index or mid not in movie_index:
      raise ValueError(f"{paths[0]}:{line}: unknown user or movie.")
    if stars not in ("1", "2", "3", "4", "5"):
      raise ValueError(f"{paths[0]}:{line}: rating {stars!r} not 1..5.")
  u = np.array([user_index[r[0]] for r in inter], np.int32)
  m = np.array([movie_index[r[1]] for r in inter], np.int32)
  stars = np.array([r[2] for r in inter], np.int64)
  ratings = {
    "user_id": u,
    "movie_id": m,
    "rating": ((stars - 1) / 4).astype(np.float32),
    "raw_rating": stars.astype(np.float32),
    "timestamp": np.array([r[3] for r in inter], np.int64),
  }
  ratings.update({f"user_{k}": v[u] for k, v in user.items()})
  ratings.update({f"movie_{k}": v[m] for k, v in movie.items()})
  return MovieLens100K(ratings, len(user_index), len(movie_index), directory)


def _user_table(
  users: list[list[str]], index: dict[str, int], path: str
) -> dict[str, np.ndarray]:
  """Per-user features, row ``index[raw_id]``."""
  occupation = {name: i for i, name in enumerate(OCCUPATIONS)}
  order = sorted(range(len(users)), key=lambda r: index[users[r][0]])
  for r in order:
    if users[r][2] not in ("F", "M") or users[r][3] not in occupation:
      raise ValueError(f"{path}:{r + 2}: bad gender or occupation.")
  rows = [users[r] for r in order]
  return {
    "age": np.array([int(row[1]) for row in rows], np.int32),
    "gender": np.array([row[2] == "M" for row in rows], np.int32),
    "occupation": np.array([occupation[row[3]] for row in rows], np.int32),
    "zip_code": np.array([row[4] for row in rows], object),
  }


def _movie_table(
  items: list[list[str]], index: dict[str, int], path: str
) -> dict[str, object]:
  """Per-movie features, row ``index[raw_id]``; genres as an object array."""
  genre = {name: i for i, name in enumerate(GENRES)}
  order = sorted(range(len(items)), key=lambda r: index[items[r][0]])
  genres = np.empty(len(items), object)
  for n, r in enumerate(order):
    names = items[r][3].split(" ")
    if any(g not in genre for g in names):
      raise ValueError(f"{path}:{r + 2}: unknown genre in {items[r][3]!r}.")
    genres[n] = np.array([genre[g] for g in names], np.int32)
  rows = [items[r] for r in order]
  return {
    "title": np.array([row[1] for row in rows], object),
    # Two movies have no year: "unkonwn" (sic) and "V" (a video release).
    "release_year": np.array(
      [int(row[2]) if row[2].isdigit() else 0 for row in rows], np.int32
    ),
    "genres": genres,
  }


def split_indices(
  num_examples: int, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """A random train/test split of ``range(num_examples)``.

  Args:
    num_examples: examples to split.
    test_fraction: share of the test split (rounded).
    seed: the permutation's seed (``np.random.default_rng``).

  Returns:
    ``(train, test)`` sorted index arrays.

  Example:
    >>> from model_garden.ranking.data import movielens
    >>> train, test = movielens.split_indices(10, 0.2, seed=1)
    >>> len(train), len(test), sorted(set(train) | set(test)) == list(
    ...   range(10))
    (8, 2, True)
  """
  if not 0.0 <= test_fraction <= 1.0:
    raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}.")
  order = np.random.default_rng(seed).permutation(num_examples)
  num_test = int(round(num_examples * test_fraction))
  return np.sort(order[num_test:]), np.sort(order[:num_test])


def select(ml: MovieLens100K, indices: np.ndarray) -> dict[str, object]:
  """The ratings at ``indices`` (genres as a ``tf.RaggedTensor``)."""
  out = {}
  for key, values in ml.ratings.items():
    if key == "movie_genres":
      rows = values[indices]
      out[key] = tf.RaggedTensor.from_row_lengths(
        np.concatenate(list(rows)), [len(r) for r in rows]
      )
    else:
      out[key] = values[indices]
  return out


def datasets(
  directory: str | None = None,
  *,
  test_fraction: float = 0.2,
  seed: int = 0,
) -> tuple[tf.data.Dataset, tf.data.Dataset]:
  """Train and test ``tf.data`` datasets of single ratings.

  Args:
    directory: the data (default: the installed recbole's copy).
    test_fraction: share of ratings in the test split (0.2: 80,000 /
      20,000).
    seed: the split's seed.

  Returns:
    ``(train, test)``, unbatched; each element a dict of the module
    table's features (``movie_genres`` batches into a ragged tensor).

  Example:
    >>> from model_garden.ranking.data import movielens
    >>> train, test = movielens.datasets()
    >>> int(train.cardinality()), int(test.cardinality())
    (80000, 20000)
  """
  ml = load(directory)
  train, test = split_indices(len(ml), test_fraction, seed)
  return (
    tf.data.Dataset.from_tensor_slices(select(ml, train)),
    tf.data.Dataset.from_tensor_slices(select(ml, test)),
  )
