"""The corpus of real-world errors (tests/faults/real_world.py, each cited there): for each, the doctor rule that
must name it and words its message must hold (the names the user needs), in the groups that run as phases of one
process (errors named by different rules, or by words that tell them apart, that do not interact). Read by
tests/doctor/test_doctor_corpus.py."""

# error, the rule that must name it, words of its message
ERRORS = [
    ("so_60335387", "grads_not_cleared", ["never cleared between optimizer steps", "zero_grad()"]),
    ("wekws_72", "grads_not_cleared", ["never cleared between optimizer steps"]),
    (
        "forum_84911",
        "mostly_frozen",
        [
            "requires_grad=False: classifier.* (4 tensors",
            "what trains: features.bn2.* (2 tensors, 32 elements), features.bn1.*",
            "only normalization layers (BatchNorm2d) train",
        ],
    ),
    ("fcn_57", "eval_mode_in_training", ["in eval mode", "features.bn1, features.bn2, classifier.drop"]),
    ("hvpnet_5", "grads_not_optimized", ["in no optimizer: head.* (2 tensors, 110 elements)"]),
    ("adapters_260", "grads_not_optimized", ["in no optimizer: adapter.* (4 tensors"]),
    ("nni_4521", "grads_not_optimized", ["in no optimizer: classifier.fc1.* (2 tensors"]),
    ("pytorch_54765", "grads_not_optimized", ["in no optimizer: all of its tensors"]),
    ("torchmoji_21", "step_without_grads", ["stepped with no gradient"]),
    ("forum_153740", "frozen_params_updated", ["features.conv1.* (2 tensors)", "set_to_none"]),
    ("ivadomed_57", "scheduler_pace", ["CosineAnnealingLR", "past its T_max=100"]),
    ("pytorch_65417", "scheduler_pace", ["OneCycleLR counts optimizer steps", "once an epoch"]),
    ("m2_71", "scheduler_pace", ["LambdaLR stepped", "more often than its optimizer"]),
    ("pytorch_13494", "backward_twice", ["backpropagated twice", "NllLossBackward0"]),
    ("farm_46", "lr_zero", ["learning rate 0 since step"]),
    ("prediff_32", "accumulation_erased", ["cleared before each of them"]),
    (
        "agcn_4",
        "params_without_grads",
        ["got no gradient at its step", "features.* (8 tensors"],
    ),
    (
        "llama_scratch_5",
        "loss_input_not_logits",
        ["cross_entropy (CrossEntropyLoss) is given probabilities from a softmax", "SoftmaxBackward0"],
    ),
    ("iterfcn_7", "same_batch", ["the same batch at every one of the last", "next(iter(loader))"]),
    ("gpjax_96", "same_batch", ["the same batch at every one of the last"]),
    ("normface_4", "single_class_batches", ["each batch holds one class", "not shuffled"]),
    ("transferlearning_182", "single_class_batches", ["every target is class 0: the labels are constant"]),
    ("halo_13", "single_class_batches", ["every target is class 0: the labels are constant"]),
    ("unet_468", "clip_before_unscale", ["still holds them multiplied by its scale (65536)", "scaler.unscale_"]),
    ("lightning_9599", "clip_before_unscale", ["clips them 65536x too hard", "Call scaler.unscale_(optimizer)"]),
    ("lomo_50", "update_too_small", ["hardly move the weights", "At learning rate 5e-05"]),
    ("megatron_579", "update_too_small", ["hardly move the weights", "clip_grad_norm_ with a max_norm"]),
    ("deepspeed_697", "loss_scale_collapsed", ["the loss scale has collapsed", "steps were skipped"]),
    ("opennmt_805", "update_too_large", ["the optimizer steps rewrite the weights", "The learning rate (1)"]),
    ("kaggle_12", "loss_at_chance", ["chance level for 10 classes"]),
    ("barc_9", "input_bound", ["outside forward/backward", "batch_size 32", "num_workers=0", "starved too"]),
    ("dope_88", "input_bound", ["outside forward/backward", "batch_size 64", "num_workers=0", "starved too"]),
    ("dalle_230", "sampler_epoch_unset", ["DistributedSampler whose epoch is still 0", "set_epoch(epoch)"]),
    ("langmodel_3", "update_too_large", ["features.conv2.weight grew", "The learning rate (1)"]),
]

# one process each (and one for the healthy twins of each): a group's errors are named by different rules, or
# by messages that tell them apart, and none leaves a state the next phase's rules read (prediff_32's 4
# micro-batches a step come first: after faster phases its slower steps would read as a throughput regression;
# constant labels come last: the loss they fall to would make the next phase's loss read as diverging; lomo_50's
# rate, far below the other phases', comes first: a rate below half the job's highest is a schedule's doing; a loss
# scale that collapses comes last: its phase's steps are skipped and its losses are not finite; so does a rate far
# too large, or comes before constant labels only: the weights it blows up would be the next phase's (and so_60335387
# leaves its phase's weights blown up already, so no rate after it can grow them far); labels that do not track the
# inputs come before constant ones: the loss they hold at chance is what the next phase's labels bring down)
GROUPS = [
    ["so_60335387", "forum_84911", "hvpnet_5", "ivadomed_57", "pytorch_13494", "fcn_57"],
    [
        "prediff_32",
        "wekws_72",
        "adapters_260",
        "forum_153740",
        "pytorch_65417",
        "torchmoji_21",
        "agcn_4",
        "langmodel_3",
    ],
    ["nni_4521", "m2_71", "farm_46", "pytorch_54765", "llama_scratch_5", "dalle_230", "deepspeed_697"],
    ["lomo_50", "iterfcn_7", "unet_468", "kaggle_12", "transferlearning_182"],
    ["gpjax_96", "normface_4", "lightning_9599", "megatron_579", "opennmt_805", "halo_13"],
]

# the errors of a job that shares its core with a CPU hog (tests/doctor/test_doctor_corpus.py pins both): a loop
# that is input bound on a starved host, where the doctor must say both
STARVED = [["barc_9", "dope_88"]]
