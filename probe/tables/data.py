"""The input pipeline's table: ``torch.dataloaders``, one row per DataLoader the finder sees.

Built at query time from what ``probe.training.finder`` found (globals, the loop's locals and
``self``'s attributes at the step boundaries it already scans, the frameworks' loaders): nothing
is added to the training step. A DataLoader iterator (``it = iter(loader)``) is described from
its own copies of the loader's settings.
"""

from __future__ import annotations

import sys

from ..training import finder
from ..util.errorlog import record_error
from .registry import Column, table


@table(
    "torch.dataloaders",
    "One row per DataLoader (or DataLoader iterator) the finder sees: in __main__'s globals, the training loop's "
    "locals and their attributes, or held by a Lightning or transformers Trainer or an accelerate Accelerator.",
    columns=[
        Column(
            "name",
            "VARCHAR",
            "Name the loader was found under (a global or local such as train_loader, an attribute, or "
            "trainer.train_dataloader).",
        ),
        Column(
            "loader_type",
            "VARCHAR",
            "Class of the object found: DataLoader, a subclass (accelerate's DataLoaderShard), or an iterator such as "
            "_SingleProcessDataLoaderIter when the loop keeps iter(loader).",
        ),
        Column("dataset_type", "VARCHAR", "Class of the dataset the loader reads."),
        Column(
            "iterable_dataset",
            "BOOLEAN",
            "Whether the dataset is an IterableDataset (streamed, no __getitem__ or sampler).",
        ),
        Column(
            "batch_size",
            "BIGINT",
            "Samples per batch (from the batch sampler when one was given), NULL when the loader does not batch.",
        ),
        Column(
            "num_workers",
            "INTEGER",
            "Worker processes loading batches; 0 means the main (training) thread loads every batch itself.",
        ),
        Column(
            "pin_memory",
            "BOOLEAN",
            "Whether batches are copied into pinned memory (an iterator reports whether it actually pins: false "
            "without an accelerator).",
        ),
        Column("prefetch_factor", "INTEGER", "Batches each worker loads ahead, NULL with no workers."),
        Column("persistent_workers", "BOOLEAN", "Whether the workers are kept between epochs."),
        Column("drop_last", "BOOLEAN", "Whether the last incomplete batch of an epoch is dropped."),
        Column(
            "sampler", "VARCHAR", "Class of the sampler that orders the samples (DistributedSampler, RandomSampler)."
        ),
        Column(
            "shuffle",
            "BOOLEAN",
            "Whether that sampler shuffles (RandomSampler, or a DistributedSampler's shuffle), NULL when unknown.",
        ),
        Column(
            "sampler_epoch",
            "BIGINT",
            "The epoch a DistributedSampler was last given (set_epoch; its shuffle order is seeded by it): 0 at every "
            "epoch when set_epoch is never called. NULL for samplers without one.",
        ),
        Column(
            "source", "VARCHAR", "Where the finder saw it: __main__ (a global), frame (the loop's locals) or framework."
        ),
    ],
    examples=[
        "SELECT name, loader_type, dataset_type, batch_size, num_workers, pin_memory, prefetch_factor, "
        "persistent_workers, "
        "iterable_dataset FROM torch.dataloaders",
        "SELECT name, dataset_type, batch_size FROM torch.dataloaders WHERE num_workers = 0",
    ],
)
def dataloaders(ctx):
    if sys.modules.get("torch") is None:
        return []
    rows = []
    for found in finder.dataloaders():
        try:
            rows.append(_row(found))
        except Exception as exc:
            record_error(f"torch.dataloaders: {found.name}", exc)
    return rows


def _row(found) -> dict:
    obj = found.obj
    data = sys.modules["torch.utils.data"]
    is_iter = not isinstance(obj, data.DataLoader)
    if is_iter:  # _BaseDataLoaderIter keeps its own copies of the loader's settings, not the loader
        dataset, sampler = getattr(obj, "_dataset", None), getattr(obj, "_index_sampler", None)
        batch_size = getattr(sampler, "batch_size", None) if getattr(obj, "_auto_collation", False) else None
        workers, pin = getattr(obj, "_num_workers", None), getattr(obj, "_pin_memory", None)
        prefetch = getattr(obj, "_prefetch_factor", None)
        persistent, drop_last = getattr(obj, "_persistent_workers", None), getattr(obj, "_drop_last", None)
    else:
        dataset = obj.dataset
        batch_size = obj.batch_size if obj.batch_size is not None else getattr(obj.batch_sampler, "batch_size", None)
        workers, pin, prefetch = obj.num_workers, obj.pin_memory, obj.prefetch_factor
        persistent, drop_last = obj.persistent_workers, obj.drop_last
        sampler = vars(obj).get("batch_sampler")  # never its truth value: len() would run the user's sampler
        if sampler is None:
            sampler = vars(obj).get("sampler")
    sampler = vars(sampler).get("sampler", sampler) if hasattr(sampler, "__dict__") else sampler  # a BatchSampler's
    own = vars(sampler) if hasattr(sampler, "__dict__") else {}  # plain attributes only: no property runs here
    shuffle = own.get("shuffle")
    if shuffle is None and type(sampler).__name__ in ("RandomSampler", "SequentialSampler"):
        shuffle = type(sampler).__name__ == "RandomSampler"
    return {
        "name": found.name,
        "loader_type": type(obj).__name__,
        "dataset_type": type(dataset).__name__ if dataset is not None else None,
        "iterable_dataset": isinstance(dataset, data.IterableDataset),
        "batch_size": _int(batch_size),
        "num_workers": _int(workers),
        "pin_memory": _bool(pin),
        "prefetch_factor": _int(prefetch) if workers else None,  # torch keeps its default 2 with no workers
        "persistent_workers": _bool(persistent),
        "drop_last": _bool(drop_last),
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "shuffle": shuffle if type(shuffle) is bool else None,
        "sampler_epoch": _int(own.get("epoch")) if "num_replicas" in own else None,
        "source": found.source,
    }


def _int(v):
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _bool(v):
    return bool(v) if v is not None else None
