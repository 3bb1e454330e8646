"""What a node records about its workload: the model, the task, tokens per sample, the data's origin,
and, for the sparse embedding model on the parameter server, the bytes a step is expected to move."""

from __future__ import annotations

from typing import Any

from torch import nn

from wiiide.config import RunConfig
from wiiide.training.data import Dataset


def workload_record(cfg: RunConfig, data: Dataset, model: nn.Module) -> dict[str, Any]:
    """Metrics fields: ``model``, ``task``, ``tokens_per_sample`` (T for the language model, else 1: the
    Training Summary's tokens/s), ``data_info`` (the corpus' files and bytes, or the Zipf parameters),
    ``parameter_tensors`` (how many tensors the gradient is made of) and ``sparse_embedding``."""
    return {"model": cfg.model, "task": data.task, "tokens_per_sample": data.tokens_per_sample,
            "data_info": data.info, "parameter_tensors": sum(1 for _ in model.parameters()),
            "sparse_embedding": cfg.sparse_embedding}


def sparse_comm_expected(cfg: RunConfig, numel: int) -> dict[str, Any]:
    """The ``comm.expected`` record of the sparse parameter server (`wiiide.server.sparse.expected_bytes_per_step`),
    in the fields the harness reads (``total_bytes`` per step)."""
    from wiiide.server.sparse import expected_bytes_per_step

    table = cfg.embedding_rows * cfg.embedding_dim
    rounds = cfg.staleness_bound == 0
    figures = expected_bytes_per_step(cfg.embedding_rows, cfg.embedding_dim, numel - table, cfg.num_workers,
                                      cfg.batch_size, cfg.embedding_fields, cfg.embedding_zipf_exponent,
                                      cfg.local_steps, rounds)
    return {"scheme": "parameter-server-sparse-rows", "world_size": cfg.num_workers + 1,
            "param_bytes": 4 * numel, **figures,
            "method": "distinct Zipf rows per push (expected) x (int32 id + dim float32) + the MLP dense, "
                      + ("pushed by every worker and pulled as the averaged update" if rounds else
                         "an update one worker's push and its pull of the rows of a push of every worker")}
