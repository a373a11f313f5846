"""ZeRO-3's gradient hooks made without gathering the model (engine start-up).

DeepSpeed 0.19's ZeRO-3 optimizer, while registering its gradient-reduction hook on each
parameter (`DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks`), gathers the
parameter whole and partitions it again around the registration: an all-gather of the entire
model, one tensor after another, at every start and requeue. The gather was needed when the hook
went on the AccumulateGrad node of `param.expand_as(param)`; with torch >= 2.1 DeepSpeed registers
it with `register_post_accumulate_grad_hook` on the parameter itself (its `register_grad_hook`),
which needs no values at all, and under `parallel.zero3_gather=block` most parameters get no
hook of their own (their block's backward hook reduces them). So for the duration of that method
each parameter's `all_gather` and `partition` do nothing, except for the persistent ones
(DeepSpeed keeps parameters below `stage3_param_persistence_threshold` whole; they are gathered
as before, so every parameter leaves the method in the state it did). Measured (py-spy, llama_1b
cut to 8 layers, one rank, AMX Xeon): 1.6 s of a 10.5 s start-up; at 70B on 64 ranks it is
70.6e9 parameters gathered per rank. Applied only where DeepSpeed's hook needs no gathered
value (torch >= 2.1, DeepSpeed's own check); `tests/test_parallel.py` runs ZeRO-3 against one
rank and `tests/test_zero3_hooks.py` counts the gathers.

Why wrap DeepSpeed's method rather than leave it: DeepSpeed has no setting for it, and it grows
with the model at every requeue; the wrapper touches only per-parameter attributes DeepSpeed
itself sets (`_convert_to_deepspeed_param`) and restores them.
"""
import contextlib


def _nothing(*args, **kwargs):
    return None


def needs_no_gather() -> bool:
    """True where DeepSpeed registers its gradient hooks on the parameter itself."""
    from deepspeed.utils.torch import required_torch_version

    return required_torch_version(min_version=2.1)


@contextlib.contextmanager
def hooks_without_gathering():
    """Within: ZeRO-3 optimizers made here register their hooks without gathering the model."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    if not needs_no_gather():
        yield
        return
    original = Stage3.create_reduce_and_remove_grad_hooks

    def create_hooks(optimizer):
        held = [p for group in optimizer.fp16_groups for p in group
                if p.requires_grad and not getattr(p, "ds_persist", False)]
        saved = [(p, p.all_gather, p.partition) for p in held]
        for p in held:
            p.all_gather = p.partition = _nothing
        try:
            return original(optimizer)
        finally:
            for p, gather, partition in saved:
                p.all_gather, p.partition = gather, partition

    Stage3.create_reduce_and_remove_grad_hooks = create_hooks
    try:
        yield
    finally:
        Stage3.create_reduce_and_remove_grad_hooks = original
