"""Compatibility layer over DeepSpeed's internals: each rank's gradients (`grads`) and fp32
master shards (`shards`) under every ZeRO stage and tensor-parallel slicing, for the callbacks
that act on them (EMA, per-layer clipping, gradient-norm monitor)."""
