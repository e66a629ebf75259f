"""The distributed corpus (tests/faults/real_world_ddp.py): for each error, the doctor rule that must name it
across ranks (``probe --ranks all doctor``), the rank it names (None: the job), its least severity, and words
its message must hold. Read by tests/doctor/test_doctor_corpus_ddp.py."""

DDP_ERRORS = {
    # error: (rule, rank, severity, words of its message)
    "no_wrapper": (
        "weights_diverged",
        None,
        "warning",
        ["the DDP replicas of model hold different weights", "first encoder.fc1.weight"],
    ),
    "buffers": (
        "ddp_buffers_not_broadcast",
        0,
        "warning",
        ["broadcast_buffers=False", "BatchNorm modules (encoder.bn) on ranks 0,1"],
    ),
    "unused": ("ddp_unused_search", 0, "info", ["find_unused_parameters=True", "found an unused parameter"]),
    "rank_local": (
        "weights_diverged",
        None,
        "warning",
        ["2 of 8 parameter tensors differ", "first head.* (2 tensors)"],
    ),
    "same_data": ("ranks_same_data", None, "warning", ["the 2 DDP ranks", "copies of one shard", "DistributedSampler"]),
    "same_data_dropout": (
        "ranks_same_data",
        None,
        "warning",
        ["the 2 DDP ranks were fed the same input on every rank", "DistributedSampler"],
    ),
    "uneven": (
        "collective_mismatch",
        1,
        "critical",
        [
            "rank 1 left the other ranks' path",
            "it issued barrier at <module> (real_world_ddp.py:",
            "rank 0 issued broadcast",
        ],
    ),
}
