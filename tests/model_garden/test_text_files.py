"""model_garden text_files: globbing, numbered chunks, sharding."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from model_garden.ranking.data import text_files


def _write(directory, name: str, lines: list[str]) -> str:
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  return path


@pytest.fixture
def three_files(tmp_path) -> list[str]:
  """Files a (3 lines), b (2 lines), c (4 lines)."""
  sizes = {"a": 3, "b": 2, "c": 4}
  return [
    _write(tmp_path, f"{n}.txt", [f"{n}{i}" for i in range(1, k + 1)])
    for n, k in sizes.items()
  ]


def _records(ds: tf.data.Dataset) -> list[tuple[str, int, str]]:
  out = []
  for chunk in ds.as_numpy_iterator():
    for f, n, line in zip(
      chunk["file"], chunk["line_number"], chunk["line"], strict=True
    ):
      out.append((os.path.basename(f.decode()), int(n), line.decode()))
  return out


def test_list_files_sorts_dedups_and_fails_on_no_match(tmp_path, three_files):
  pattern = str(tmp_path / "*.txt")
  files = text_files.list_files([pattern, three_files[1]])
  assert files == sorted(three_files)
  with pytest.raises(FileNotFoundError, match="No file matches"):
    text_files.list_files(str(tmp_path / "*.csv"))


def test_numbered_lines_keeps_file_and_line_number(three_files):
  ds = text_files.numbered_lines(three_files, 2, cycle_length=1)
  got = _records(ds)
  want = [
    (f"{n}.txt", i, f"{n}{i}")
    for n, k in (("a", 3), ("b", 2), ("c", 4))
    for i in range(1, k + 1)
  ]
  assert got == want
  chunk_sizes = [len(c["line"]) for c in ds.as_numpy_iterator()]
  assert chunk_sizes == [2, 1, 2, 2, 2]


def test_numbered_lines_interleaves_files_chunk_by_chunk(three_files):
  ds = text_files.numbered_lines(three_files, 2, cycle_length=3)
  first_files = [
    os.path.basename(c["file"][0].decode()) for c in ds.as_numpy_iterator()
  ]
  assert first_files[:3] == ["a.txt", "b.txt", "c.txt"]
  assert sorted(_records(ds)) == sorted(
    _records(text_files.numbered_lines(three_files, 2, cycle_length=1))
  )


def test_numbered_lines_shards_files_between_input_pipelines(three_files):
  shards = [
    _records(
      text_files.numbered_lines(
        three_files,
        4,
        input_context=tf.distribute.InputContext(2, i, 2),
      )
    )
    for i in range(2)
  ]
  assert {r[0] for r in shards[0]} == {"a.txt", "c.txt"}
  assert {r[0] for r in shards[1]} == {"b.txt"}


def test_numbered_lines_shards_lines_when_files_are_fewer(three_files):
  one_file = three_files[2:]
  shards = [
    _records(
      text_files.numbered_lines(
        one_file, 4, input_context=tf.distribute.InputContext(2, i, 2)
      )
    )
    for i in range(2)
  ]
  assert [r[1] for r in shards[0]] == [1, 3]
  assert [r[1] for r in shards[1]] == [2, 4]


def test_numbered_lines_repeat(three_files):
  ds = text_files.numbered_lines(three_files[:1], 10, repeat=True)
  got = [c["line_number"].tolist() for c in ds.take(2).as_numpy_iterator()]
  assert got == [[1, 2, 3], [1, 2, 3]]


def test_repeated_files_are_read_once_per_pass_whatever_the_cycle_length(
  tmp_path,
):
  path = tmp_path / "one.txt"
  path.write_text("".join(f"{i}\n" for i in range(1, 7)))
  chunks = text_files.numbered_lines(
    [str(path)], 2, cycle_length=10, repeat=True
  )
  numbers = [
    c["line_number"].tolist() for c in chunks.take(5).as_numpy_iterator()
  ]
  assert numbers == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4]]
