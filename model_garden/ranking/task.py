"""``RankingTask``: the model, its embedding, optimizers and steps.

Built under a strategy from an ``ExperimentConfig``, as Model Garden's
``RankingTask.build_model``, but the embedding work is all
``tpu_embedding``'s: the TPU mid-level loop

.. code-block:: python

  embedding.enqueue(sparse_features)          # per-replica ids
  def replica_fn(dense_features, labels):     # inside strategy.run
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      loss = bce(labels, model(dense_features, activations)) / global batch
    grads = tape.gradient(loss, [activations, dense variables])
    finite = all replicas' gradients are finite
    embedding.apply_gradients(embedding grads, skip=not finite)
    if finite: dense_optimizer.apply_gradients(...)

runs on every strategy: the default one, ``MirroredStrategy`` and
``MultiWorkerMirroredStrategy`` (big tables row-sharded over the
replicas), ``ParameterServerStrategy`` (steps scheduled by a
``ClusterCoordinator``) and ``TPUStrategy`` (TensorFlow's TPU embedding).
Each replica's loss is its examples' summed cross-entropy over the global
batch size, so both the tables' row gradients (summed over the global
batch by ``tpu_embedding``) and the dense gradients (summed over replicas
by Keras) are those of the global mean loss.

A step whose gradients are not finite (anywhere: dense or embedding, on
any replica) is skipped as a whole (``finite_steps``): no table row, slot,
dense weight or dense optimizer state changes; the global step still
advances (its batch is consumed) and the step reports ``skipped``. Off TPU
only: TensorFlow's TPU embedding updates unconditionally.

``runtime.mixed_precision_dtype`` (``mixed_bfloat16``, ``mixed_float16``)
is the dense model's Keras dtype policy: float32 weights, 16-bit
computations; the tables and their activations stay float32 and are cast
where they enter the model, the logits come back in float32.
``mixed_float16`` also scales the loss (``loss_scale``), dividing both the
dense and the embedding gradients by the scale.

Steps return additive metric statistics (``metrics.batch_statistics``),
summed over replicas, instead of updating Keras metrics: the trainer adds
them up on the host, exactly even when parameter-server workers run steps
concurrently.

The table optimizer's learning rate reads ``step`` (the global step,
incremented after each training step); ``checkpoint`` holds the
embedding (tables and slots), the model, the dense optimizer, ``step``
and, with ``mixed_float16``, the loss scale.

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking import configs
  >>> from model_garden.ranking.task import RankingTask
  >>> config = configs.override(configs.get_config("dlrm_criteo_cpu_small"),
  ...   {"task": {"model": {"vocab_sizes": [50] * 26}}})
  >>> task = RankingTask(config, tf.distribute.get_strategy(), seed=1)
  >>> sorted(task.embedding.variables)[:2], int(task.step)
  (['embedding_table_00', 'embedding_table_01'], 0)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from model_garden.ranking import embedding as ranking_embedding
from model_garden.ranking import finite_steps
from model_garden.ranking import model as ranking_model
from model_garden.ranking import optimizers
from model_garden.ranking.configs import definitions
from model_garden.ranking.loss_scale import LossScale
from model_garden.ranking.metrics import batch_statistics


def _is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
  return isinstance(
    strategy, tf.distribute.experimental.ParameterServerStrategy
  )


def _is_tpu(strategy: tf.distribute.Strategy) -> bool:
  return isinstance(
    strategy,
    (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy),
  )


def per_example_loss(
  labels: tf.Tensor, logits: tf.Tensor, label_smoothing: float = 0.0
) -> tf.Tensor:
  """Binary cross-entropy of each example, from logits.

  Example:
    >>> import tensorflow as tf
    >>> from model_garden.ranking.task import per_example_loss
    >>> loss = per_example_loss(tf.constant([1.0, 0.0]), tf.constant([0., 0.]))
    >>> [round(float(x), 4) for x in loss]
    [0.6931, 0.6931]
  """
  labels = tf.cast(labels, logits.dtype)
  if label_smoothing:
    labels = labels * (1.0 - label_smoothing) + 0.5 * label_smoothing
  return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)


#: ``runtime.mixed_precision_dtype`` values -> the dense model's Keras policy.
PRECISION_POLICIES = {
  "float32": None,
  "mixed_bfloat16": "mixed_bfloat16",
  "mixed_float16": "mixed_float16",
}


class RankingTask:
  """A ranking model's embedding, dense model, optimizers and steps.

  Args:
    config: the experiment.
    strategy: the strategy everything is created under.
    seed: seeds the tables' initializers (the same values on any number
      of replicas); None: unseeded. Seed Keras with
      ``keras.utils.set_random_seed`` for the dense layers.

  Attributes:
    config: the experiment config.
    strategy: the strategy.
    step: the global step (int64 variable).
    embedding: the ``tpu_embedding.TPUEmbedding`` of the tables.
    model: the dense ``model.RankingModel`` (logits).
    dense_optimizer: the dense layers' Keras optimizer.
    embedding_optimizer: the tables' ``tpu_embedding`` optimizer.
    loss_scale: the ``LossScale`` of ``mixed_float16``, else None.
    checkpoint: ``tf.train.Checkpoint`` of all of the above's state.

  Raises:
    ValueError: for an unknown ``runtime.mixed_precision_dtype``.
  """

  def __init__(
    self,
    config: definitions.ExperimentConfig,
    strategy: tf.distribute.Strategy,
    *,
    seed: int | None = None,
  ):
    self.config = config
    self.strategy = strategy
    model_config = config.task.model
    optimization = config.trainer.optimizer_config
    batch_size = config.task.train_data.global_batch_size
    replicas = strategy.num_replicas_in_sync
    precision = config.runtime.mixed_precision_dtype
    if precision not in PRECISION_POLICIES:
      raise ValueError(
        f"runtime.mixed_precision_dtype must be one of "
        f"{sorted(PRECISION_POLICIES)}, got {precision!r}."
      )
    self._skips = not _is_tpu(strategy)
    with strategy.scope():
      self.step = tf.Variable(
        0, dtype=tf.int64, trainable=False, name="global_step"
      )
      self.model = ranking_model.build_model(
        model_config, dtype=PRECISION_POLICIES[precision]
      )
      self.model(ranking_model.example_inputs(model_config))
      self.dense_optimizer = optimizers.dense_optimizer(
        optimization, batch_size
      )
      self.dense_optimizer.build(self.model.trainable_variables)
      self.embedding_optimizer = optimizers.embedding_optimizer(
        optimization, batch_size, self.step
      )
      self.embedding = ranking_embedding.make_embedding(
        model_config,
        self.embedding_optimizer,
        seed=seed,
        pipeline=config.trainer.pipeline_sparse_and_dense_execution,
        per_replica_batch_size=(
          batch_size // replicas if _is_tpu(strategy) else None
        ),
        strategy=config.runtime.distribution_strategy,
      )
      self.embedding.build()
      self.loss_scale = (
        LossScale.from_config(config.runtime.loss_scale)
        if precision == "mixed_float16"
        else None
      )
    state: dict[str, Any] = {
      "embedding": self.embedding,
      "model": self.model,
      "dense_optimizer": self.dense_optimizer,
      "step": self.step,
    }
    if self.loss_scale is not None:
      state["loss_scale"] = self.loss_scale
    self.checkpoint = tf.train.Checkpoint(**state)
    self._train_step = None
    self._eval_step = None
    self._flush = None

  # --- learning rates ------------------------------------------------------

  def learning_rates(self) -> dict[str, float]:
    """The tables' and the dense layers' learning rates now (for logs).

    Example:
      >>> import tensorflow as tf
      >>> from model_garden.ranking import configs
      >>> from model_garden.ranking.task import RankingTask
      >>> config = configs.override(configs.get_config(
      ...   "dlrm_criteo_cpu_small"), {"task.model.vocab_sizes": [9] * 26})
      >>> rates = RankingTask(config, tf.distribute.get_strategy()
      ...                     ).learning_rates()
      >>> sorted(rates), round(rates["dense_learning_rate"], 4)
      (['dense_learning_rate', 'learning_rate'], 0.001)
    """
    return {
      "learning_rate": float(self.embedding_optimizer.learning_rate_tensor()),
      "dense_learning_rate": float(
        tf.convert_to_tensor(_value(self.dense_optimizer.learning_rate))
      ),
    }

  # --- per-replica computations --------------------------------------------

  def _logits(
    self, dense_features: tf.Tensor, activations: Any, training: bool
  ) -> tf.Tensor:
    """The model's logits; dense features in their split's ``dtype`` (the
    model casts its inputs to its compute dtype on entry)."""
    data = (
      self.config.task.train_data
      if training
      else (self.config.task.validation_data)
    )
    return self.model(
      {
        "dense_features": tf.cast(dense_features, data.dtype),
        "embeddings": ranking_embedding.activations_in_order(activations),
      },
      training=training,
    )

  def _replica_train(
    self, dense_features: tf.Tensor, labels: tf.Tensor
  ) -> dict[str, Any]:
    """One replica's forward, backward and (unless skipped) updates."""
    global_batch = self.config.task.train_data.global_batch_size
    smoothing = self.config.task.loss.label_smoothing
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      activations = self.embedding.dequeue()
      tape.watch(activations)
      logits = self._logits(dense_features, activations, training=True)
      losses = per_example_loss(labels, logits, smoothing)
      loss = tf.nn.compute_average_loss(losses, global_batch_size=global_batch)
      scaled = (
        loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)
      )
    embedding_grads, dense_grads = tape.gradient(
      scaled, [activations, variables]
    )
    if self.loss_scale is not None:
      embedding_grads, dense_grads = self.loss_scale.unscale(
        [embedding_grads, dense_grads]
      )
    if self._skips:
      finite = finite_steps.on_all_replicas(
        finite_steps.all_finite([embedding_grads, dense_grads])
      )
      self.embedding.apply_gradients(
        embedding_grads, skip=tf.logical_not(finite)
      )
      finite_steps.apply_if(
        self.dense_optimizer, dense_grads, variables, finite
      )
    else:  # TPU: TensorFlow's TPU embedding updates unconditionally.
      finite = tf.constant(True)
      self.embedding.apply_gradients(embedding_grads)
      self.dense_optimizer.apply_gradients(
        zip(dense_grads, variables, strict=True)
      )
    if self.loss_scale is not None:
      self.loss_scale.update(finite)
    result: dict[str, Any] = {
      "loss": loss,
      "skipped": tf.cast(tf.logical_not(finite), tf.float32),
    }
    if self.config.trainer.enable_metrics_in_training:
      result["statistics"] = batch_statistics(
        labels, tf.sigmoid(logits), losses
      )
    return result

  def _replica_eval(
    self, dense_features: tf.Tensor, labels: tf.Tensor
  ) -> dict[str, tf.Tensor]:
    activations = self.embedding.dequeue()
    logits = self._logits(dense_features, activations, training=False)
    losses = per_example_loss(labels, logits)
    return batch_statistics(labels, tf.sigmoid(logits), losses)

  # --- steps ---------------------------------------------------------------

  @property
  def train_step(self) -> Any:
    """``train_step(features, labels) -> result``: one global step.

    ``features`` and ``labels`` are one element of the distributed
    training dataset (per-replica values). Increments ``step``. Returns
    ``{"loss": the global mean loss, "skipped": 1.0 if the step's
    gradients were not finite (nothing was updated) else 0.0,
    "statistics": metrics.batch_statistics of the global batch}`` (no
    statistics without ``trainer.enable_metrics_in_training``). Under
    ``ParameterServerStrategy`` it runs on a worker: schedule it with a
    ``ClusterCoordinator`` on per-worker iterators (``train_step_ps``).
    """
    if self._train_step is None:
      self._train_step = tf.function(self._train_step_fn)
    return self._train_step

  def _train_step_fn(self, features: Any, labels: Any) -> dict[str, Any]:
    strategy = self.strategy
    if _is_parameter_server(strategy):

      def replica_fn(features, labels):
        self.embedding.enqueue(features["sparse_features"], training=True)
        return self._replica_train(features["dense_features"], labels)

      result = strategy.run(replica_fn, args=(features, labels))
    else:
      self.embedding.enqueue(features["sparse_features"], training=True)
      result = strategy.run(
        self._replica_train, args=(features["dense_features"], labels)
      )
    self.step.assign_add(1)
    result = _sum_over_replicas(strategy, result)
    # Every replica reports the same verdict: the sum counts it per replica.
    result["skipped"] = tf.minimum(result["skipped"], 1.0)
    return result

  @property
  def eval_step(self) -> Any:
    """``eval_step(features, labels) -> statistics``: a batch's
    ``metrics.batch_statistics``, summed over replicas."""
    if self._eval_step is None:
      self._eval_step = tf.function(self._eval_step_fn)
    return self._eval_step

  def _eval_step_fn(self, features: Any, labels: Any) -> dict[str, tf.Tensor]:
    strategy = self.strategy
    if _is_parameter_server(strategy):

      def replica_fn(features, labels):
        self.embedding.enqueue(features["sparse_features"], training=False)
        return self._replica_eval(features["dense_features"], labels)

      result = strategy.run(replica_fn, args=(features, labels))
    else:
      self.embedding.enqueue(features["sparse_features"], training=False)
      result = strategy.run(
        self._replica_eval, args=(features["dense_features"], labels)
      )
    return _sum_over_replicas(strategy, result)

  def flush_pipeline(self) -> None:
    """Applies the table update held back by pipelining (else a no-op).

    With ``trainer.pipeline_sparse_and_dense_execution`` the last step's
    table update waits for the next lookup; the trainer flushes it before
    checkpoints, evaluations and exports (at the same steps in an
    interrupted and an uninterrupted run, so both stay identical).
    """
    if not self.config.trainer.pipeline_sparse_and_dense_execution:
      return
    if self._flush is None:
      self._flush = tf.function(
        lambda: self.strategy.run(self.embedding.flush_pipeline)
      )
    self._flush()

  def train_step_ps(self, iterator: Any) -> dict[str, Any]:
    """The step a ``ClusterCoordinator`` schedules: reads its own batch."""
    features, labels = next(iterator)
    return self.train_step(features, labels)

  def eval_step_ps(self, iterator: Any) -> dict[str, tf.Tensor]:
    """The evaluation step a ``ClusterCoordinator`` schedules."""
    features, labels = next(iterator)
    return self.eval_step(features, labels)


def _value(variable: Any) -> Any:
  """A Keras variable's TensorFlow variable (else the value itself)."""
  return getattr(variable, "value", variable)


def _sum_over_replicas(strategy: tf.distribute.Strategy, result: Any) -> Any:
  return tf.nest.map_structure(
    lambda value: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None),
    result,
  )
