"""The corpus of real-world errors (tests/faults/real_world.py): for each, the doctor rule that must name it and
words its message must hold (the names the user needs). Read by tests/test_doctor_corpus.py."""

ERRORS = [
    # error, the rule that must name it, words of its message
    ("so_60335387", "grads_not_cleared", ["never cleared between optimizer steps", "zero_grad()"]),
    ("forum_84911", "mostly_frozen", ["requires_grad=False: classifier.* (4 tensors", "what trains: features.bn2.* (2 tensors, 32 elements), features.bn1.*",
                                      "only normalization layers (BatchNorm2d) train"]),
    ("fcn_57", "eval_mode_in_training", ["in eval mode", "features.bn1, features.bn2, classifier.drop"]),
    ("hvpnet_5", "grads_not_optimized", ["in no optimizer: head.* (2 tensors, 110 elements)"]),
]
