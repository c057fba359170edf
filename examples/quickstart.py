"""Quickstart: train embeddings with the TPU-style loop on CPU.

A synthetic click task that needs no download: each user and item has a
hidden vector and bias; a click happens with probability
sigmoid(<user, item> + user bias + item bias). The
model looks up a user table and an item table (the item table is shared by
the clicked item and the user's ragged history of items), concatenates the
activations and feeds a small Keras MLP. Tables train with their own sparse
optimizers (Adagrad, FTRL) through ``enqueue`` → ``dequeue`` →
``apply_gradients``; the MLP trains with Keras Adam.

Run:
  python3 examples/quickstart.py --steps 300 --logdir /tmp/tpe_quickstart

It logs loss, AUC and examples/s, writes TensorBoard summaries to
``--logdir`` and prints the held-out AUC at the end (a random model gets
0.5).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402

NUM_USERS = 2_000
NUM_ITEMS = 5_000
HIDDEN_DIM = 8


def make_dataset(seed: int, batch_size: int) -> tf.data.Dataset:
  """Endless batches of (features, labels) from a fixed hidden model."""
  truth = np.random.default_rng(0)
  user_vectors = truth.normal(size=(NUM_USERS, HIDDEN_DIM))
  item_vectors = truth.normal(size=(NUM_ITEMS, HIDDEN_DIM))
  user_bias = truth.normal(size=NUM_USERS) * 2
  item_bias = truth.normal(size=NUM_ITEMS) * 2
  rng = np.random.default_rng(seed)

  def batches():
    while True:
      users = rng.integers(0, NUM_USERS, batch_size)
      # Skewed item popularity, as in real logs.
      items = np.minimum(rng.zipf(1.3, batch_size) - 1, NUM_ITEMS - 1)
      logits = (
        np.sum(user_vectors[users] * item_vectors[items], axis=1)
        + user_bias[users]
        + item_bias[items]
      )
      labels = rng.random(batch_size) < 1 / (1 + np.exp(-logits))
      lengths = rng.integers(0, 6, batch_size)
      history = np.minimum(rng.zipf(1.3, lengths.sum()) - 1, NUM_ITEMS - 1)
      yield (
        {
          "user": users,
          "item": items,
          "history_values": history,
          "history_lengths": lengths,
        },
        labels.astype(np.float32),
      )

  signature = (
    {
      "user": tf.TensorSpec([None], tf.int64),
      "item": tf.TensorSpec([None], tf.int64),
      "history_values": tf.TensorSpec([None], tf.int64),
      "history_lengths": tf.TensorSpec([None], tf.int64),
    },
    tf.TensorSpec([None], tf.float32),
  )

  def to_features(raw, labels):
    history = tf.RaggedTensor.from_row_lengths(
      raw["history_values"], raw["history_lengths"]
    )
    return {
      "user": raw["user"],
      "item": raw["item"],
      "history": history,
    }, labels

  return (
    tf.data.Dataset.from_generator(batches, output_signature=signature)
    .map(to_features)
    .prefetch(2)
  )


def logits_from(mlp, activations) -> tf.Tensor:
  """The click logit: the MLP over the activations and a user-item product."""
  user, item = activations["user"], activations["item"]
  features = [user, item, activations["history"], user * item]
  return mlp(tf.concat(features, axis=1))[:, 0]


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=600, help="Train steps.")
  parser.add_argument(
    "--batch_size", type=int, default=512, help="Examples per step."
  )
  parser.add_argument(
    "--log_every", type=int, default=100, help="Steps between log lines."
  )
  parser.add_argument(
    "--logdir",
    default="/tmp/tpu_embedding_quickstart",
    help="TensorBoard summaries go here.",
  )
  args = parser.parse_args()

  user_table = tpe.TableConfig(
    NUM_USERS, 16, name="users", optimizer=tpe.FTRL(0.05)
  )
  item_table = tpe.TableConfig(NUM_ITEMS, 16, name="items", combiner="mean")
  feature_config = {
    "user": tpe.FeatureConfig(user_table),
    "item": tpe.FeatureConfig(item_table),
    "history": tpe.FeatureConfig(item_table),
  }
  embedding = tpe.TPUEmbedding(feature_config, tpe.Adagrad(0.1))
  mlp = keras.Sequential(
    [
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(1),
    ]
  )
  dense_optimizer = keras.optimizers.Adam(1e-3)
  auc = keras.metrics.AUC()

  @tf.function
  def train_step(features, labels):
    embedding.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      logits = logits_from(mlp, activations)
      loss = tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(labels, logits)
      )
    grads = tape.gradient(loss, [activations, mlp.trainable_variables])
    embedding.apply_gradients(grads[0])
    dense_optimizer.apply_gradients(
      zip(grads[1], mlp.trainable_variables, strict=True)
    )
    auc.update_state(labels, tf.sigmoid(logits))
    return loss

  writer = tf.summary.create_file_writer(args.logdir)
  train = iter(make_dataset(seed=1, batch_size=args.batch_size))
  last_time, last_step = time.perf_counter(), 0
  with writer.as_default():
    for step in range(1, args.steps + 1):
      loss = train_step(*next(train))
      if step % args.log_every == 0 or step == args.steps:
        now = time.perf_counter()
        rate = (step - last_step) * args.batch_size / (now - last_time)
        last_time, last_step = now, step
        tf.summary.scalar("loss", loss, step=step)
        tf.summary.scalar("auc", auc.result(), step=step)
        tf.summary.scalar("examples_per_second", rate, step=step)
        print(
          f"step {step:5d}/{args.steps}  loss {float(loss):.4f}  "
          f"train AUC {float(auc.result()):.4f}  {rate:,.0f} examples/s",
          flush=True,
        )
        auc.reset_state()

  test_auc = keras.metrics.AUC()
  for features, labels in make_dataset(seed=2, batch_size=2048).take(5):
    activations = embedding(features)
    logits = logits_from(mlp, activations)
    test_auc.update_state(labels, tf.sigmoid(logits))
  print(
    f"held-out AUC: {float(test_auc.result()):.4f} "
    f"(TensorBoard logs in {args.logdir})"
  )


if __name__ == "__main__":
  main()
